"""The conversions: HF (or Meta) directory -> msllm ``.ckpt`` + manifest, and msllm (or
MindFormers-named) ``.ckpt`` -> HF directory loadable by ``transformers``.

Memory: every conversion reads its input one tensor at a time (plain reads at recorded offsets;
``.bin``/``.pth`` through ``torch.load(mmap=True, weights_only=True)``) and writes its output one
tensor at a time, so the peak is about one tensor plus its dtype-cast copy, independent of the
model size (measured in ``benchmarks/convert_peak_rss.py``).

Atomicity: the ``.ckpt`` is written through :func:`msllm.fileio.atomic_path`, its manifest after
it; an HF directory is written as a temporary directory beside the target and renamed at the end.
Every input problem raises one :class:`MsllmError` naming the file and tensor or key, before any
output is published. torch / transformers are imported only inside the functions that need them.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from msllm.convert.configs import msllm_config_to_hf
from msllm.convert.sources import open_hf_source
from msllm.convert.tokenizer_export import export_tokenizer, recorded_tokenizer
from msllm.errors import MsllmError
from msllm.fileio import atomic_path, write_json_atomic
from msllm.formats.dtypes import FLOAT_DTYPES, STORAGE, TensorRef, cast, normalize_dtype, tensor_nbytes
from msllm.formats.manifest import manifest_model_config, read_sidecar, sidecar_path, verify_checkpoint, write_sidecar
from msllm.formats.mindformers import fused_parts, msllm_name_map, split_fused
from msllm.formats.mindspore_ckpt import CkptWriter, scan_checkpoint
from msllm.formats.safetensors import SafetensorsWriter
from msllm.models.llama.config import LlamaConfig
from msllm.convert.experts import file_name, file_tensors
from msllm.models.llama.names import is_trainer_entry, msllm_to_hf_name, param_shapes


def parse_size(text) -> int:
    """``"2GB"`` -> 2 * 10**9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 (bytes); units as
    transformers ``convert_file_size_to_int``. MsllmError for anything else."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise MsllmError(f"--max_shard_size {text!r}: expected bytes or a size like 2GB, 500MB, 1GiB")
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    value = float(m.group(1)) * (units[m.group(2).upper()] if m.group(2) else 1)
    if value < 1:
        raise MsllmError(f"--max_shard_size {text!r} must be at least one byte")
    return int(value)


def plan_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split tensors (in order) into shards of at most ``max_shard_size`` bytes; a tensor larger
    than that gets a shard of its own (as transformers ``split_torch_state_dict_into_shards``)."""
    shards, current, used = [], [], 0
    for name, n in sizes:
        if current and used + n > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        shards.append(current)
    return shards


# ---------------------------------------------------------------------------------------------
# Conversions.


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, dynamic_ncols=True)


@dataclass
class ConversionResult:
    """What a conversion wrote: output path, the msllm config, tensor count, bytes, dtypes."""

    output: str
    config: LlamaConfig
    tensors: int
    bytes: int
    dtypes: list
    source_kind: str
    notes: tuple = ()


def convert_hf_to_msllm(hf_dir: str, out_path: str, dtype: Optional[str] = None, progress: bool = True,
                        before_publish: Optional[Callable[[str, LlamaConfig], None]] = None) -> ConversionResult:
    """HF (or Meta) checkpoint directory -> msllm ``.ckpt`` + manifest (``OUT.ckpt.json``).

    Args:
        hf_dir: directory with ``config.json`` + safetensors / ``.bin`` (possibly sharded), or
            ``params.json`` + ``consolidated.NN.pth``.
        out_path: the ``.ckpt`` to write (replaced atomically if it exists).
        dtype: ``fp32``/``fp16``/``bf16`` (or long names) to cast every tensor to; None keeps
            each tensor's dtype.
        progress: show a tqdm bar over tensors (stderr).
        before_publish: called as ``before_publish(tmp_ckpt_path, config)`` after the data is
            written and before it is renamed onto ``out_path``; an exception there (e.g. a failed
            parity check) removes the output.

    Tensor names are mapped with :data:`msllm.models.llama.names.PARAM_TABLE`; values are copied bit for bit unless
    ``dtype`` casts them (and Meta wq/wk are permuted). Returns a :class:`ConversionResult`.
    Raises MsllmError (see :func:`open_hf_source`) before anything is written.
    """
    dtype = normalize_dtype(dtype)
    if not out_path.endswith(".ckpt"):
        raise MsllmError(f"--mindspore_ckpt_path {out_path!r}: expected a file name ending in .ckpt")
    src = open_hf_source(hf_dir)
    written, dtypes = 0, set()
    try:
        with atomic_path(out_path) as tmp:
            with CkptWriter(tmp) as writer, _progress(len(src.params), "hf -> msllm", progress) as bar:
                for name, ref in src.params.items():
                    out_dtype = dtype or ref.dtype
                    data = cast(ref.load(), ref.dtype, out_dtype)
                    writer.write(name, data, out_dtype)
                    written += data.nbytes
                    dtypes.add(out_dtype)
                    del data
                    bar.update(1)
            if before_publish is not None:
                before_publish(tmp, src.config)
    finally:
        src.close()
    write_sidecar(out_path, src.config, converted_from=os.path.abspath(hf_dir), source_format=src.kind,
                  dtype=sorted(dtypes)[0] if len(dtypes) == 1 else sorted(dtypes))
    return ConversionResult(out_path, src.config, len(src.params), written, sorted(dtypes), src.kind)


def msllm_model_config(ckpt_path: str, config_path: Optional[str]) -> LlamaConfig:
    """The model config of checkpoint ``ckpt_path``: its manifest's ``model_config``, else the
    ``model.model_config`` of run YAML ``config_path``.

    Raises MsllmError naming what is missing (no manifest / no model_config in it, and no
    ``--config``), a file whose size or SHA-256 disagrees with its manifest
    (:func:`msllm.formats.manifest.verify_checkpoint`), or a manifest config that disagrees
    with the ``--config`` one in a shape field.
    """
    from msllm.config import from_dict, load_config

    manifest = read_sidecar(ckpt_path)
    yaml_cfg = load_config(config_path).model_config if config_path else None
    side_cfg = None
    if manifest is not None:
        problem = verify_checkpoint(ckpt_path, full=True)  # size and SHA-256 against the manifest
        if problem:
            raise MsllmError(f"{ckpt_path} does not match its manifest {sidecar_path(ckpt_path)}: {problem} "
                             "(truncated or replaced?)")
        if manifest.get("model_config") is not None:
            try:   # manifest_model_config: without the pet_config older manifests kept in it
                side_cfg = from_dict(LlamaConfig, manifest_model_config(manifest), "model_config")
            except MsllmError as exc:
                raise MsllmError(f"{sidecar_path(ckpt_path)}: {exc}") from None
    if side_cfg is not None and yaml_cfg is not None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_heads", "ffn_size",
                    "tie_word_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps"):
            if getattr(side_cfg, key) != getattr(yaml_cfg, key):
                raise MsllmError(f"{config_path}: model_config {key}={getattr(yaml_cfg, key)!r} disagrees "
                                 f"with {sidecar_path(ckpt_path)} ({getattr(side_cfg, key)!r})")
    if side_cfg is not None:
        return side_cfg
    if yaml_cfg is not None:
        return yaml_cfg
    why = "has no manifest" if manifest is None else "has a manifest without model_config"
    raise MsllmError(f"{ckpt_path} {why} ({sidecar_path(ckpt_path)}); pass --config RUN_YAML "
                     "(the run config it was trained with) so the model shape is known")


def msllm_weights(ckpt_path: str, cfg: LlamaConfig) -> dict[str, TensorRef]:
    """The model weights of msllm (or MindFormers-named) checkpoint ``ckpt_path`` in
    :func:`param_shapes` order, trainer entries dropped, names and shapes checked against ``cfg``.

    Raises MsllmError naming the file and tensor: unknown entry, missing weight, wrong shape,
    non-float weight.
    """
    refs = scan_checkpoint(ckpt_path)
    renamed = msllm_name_map(list(refs), ckpt_path)
    items = []
    for old, ref in refs.items():
        try:
            parts = fused_parts(old, tuple(ref.shape), cfg.num_heads, cfg.kv_heads, cfg.hidden_size)
        except ValueError as exc:
            raise MsllmError(f"{ckpt_path}: {exc}") from None
        if not parts:
            items.append((old, renamed[old], ref))
            continue
        for k, (name, shape) in enumerate(parts):  # MindFormers qkv_concat: see msllm.formats.mindformers
            items.append((old, name, TensorRef(name, shape, ref.dtype, ref.where,
                                               lambda ref=ref, old=old, k=k: split_fused(
                                                   old, ref.load(), cfg.num_heads, cfg.kv_heads)[k])))
    shapes = param_shapes(cfg)
    found: dict[str, TensorRef] = {}
    for old, name, ref in items:
        if is_trainer_entry(name):
            continue
        if name not in shapes:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            raise MsllmError(f"{ckpt_path}: unknown entry {old} (not a weight of the model in the "
                             f"config, nor a trainer entry such as adam_m.* or global_step)")
        if ref.dtype not in FLOAT_DTYPES:
            raise MsllmError(f"{ckpt_path}: weight {old} has dtype {ref.dtype}; expected a float tensor")
        if tuple(ref.shape) != shapes[name]:
            raise MsllmError(f"{ckpt_path}: weight {old} has shape {list(ref.shape)}, the model config "
                             f"implies {list(shapes[name])}")
        found[name] = ref
    missing = [n for n in shapes if n not in found]
    if missing:
        raise MsllmError(f"{ckpt_path} lacks {len(missing)} weight(s) of the model, e.g. {missing[0]}")
    return {n: found[n] for n in shapes}


def convert_msllm_to_hf(ckpt_path: str, out_dir: str, config_path: Optional[str] = None,
                        dtype: Optional[str] = None, max_shard_size="2GB", progress: bool = True,
                        before_publish: Optional[Callable[[str, LlamaConfig], None]] = None,
                        tokenizer: Optional[str] = None) -> ConversionResult:
    """msllm ``.ckpt`` -> HF directory loadable by ``AutoModelForCausalLM.from_pretrained``.

    Writes ``config.json`` (:func:`msllm_config_to_hf`) and ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` when the weights exceed
    ``max_shard_size`` (bytes or ``"2GB"``-style). Model config from the checkpoint manifest, else
    ``config_path`` (:func:`msllm_model_config`). ``dtype`` None keeps each tensor's dtype. Trainer
    entries (``adam_m.*``, ``global_step`` ...) are skipped; MindFormers names are accepted.
    ``tokenizer`` (else the one the manifest records, if still there): copied beside the weights,
    its BOS / EOS / pad ids written to the configs (:mod:`msllm.convert.tokenizer_export`).

    The directory is built as a hidden temporary directory beside ``out_dir`` and renamed onto it
    at the end (after ``before_publish(tmp_dir, config)``); ``out_dir`` must not exist or be empty.
    Raises MsllmError before writing anything for bad input.
    """
    dtype = normalize_dtype(dtype)
    limit = parse_size(max_shard_size)
    if not os.path.isfile(ckpt_path):
        raise MsllmError(f"--mindspore_ckpt_path {ckpt_path}: checkpoint file not found")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise MsllmError(f"--torch_ckpt_dir {out_dir}: already exists and is not an empty directory; "
                         "remove it or choose another")
    cfg = msllm_model_config(ckpt_path, config_path)
    weights = msllm_weights(ckpt_path, cfg)
    out_dtype = {n: dtype or r.dtype for n, r in weights.items()}
    # the file tensors of each weight: one, or one per expert and projection (convert/experts.py)
    files = {n: file_tensors(n, tuple(r.shape), cfg.model_type)
             or [(file_name(n, msllm_to_hf_name(n), cfg.model_type), tuple(r.shape), None)]
             for n, r in weights.items()}
    sizes = [(n, tensor_nbytes(r.shape, out_dtype[n])) for n, r in weights.items()]
    shards = plan_shards(sizes, limit)
    total = sum(n for _, n in sizes)
    counts: dict[str, int] = {}
    for d in out_dtype.values():
        counts[d] = counts.get(d, 0) + 1
    config_dtype = max(counts, key=counts.get)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", suffix=".tmp", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the published directory gets the usual mode
    try:
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
        weight_map = {}
        with _progress(len(weights), "msllm -> hf", progress) as bar:
            for fname, shard in zip(names, shards):
                specs = [(name, out_dtype[n], shape) for n in shard for name, shape, _ in files[n]]
                with SafetensorsWriter(os.path.join(tmp, fname), specs, {"format": "pt"}) as w:
                    for n in shard:
                        ref = weights[n]
                        data = ref.load()
                        for name, _, take in files[n]:
                            part = data if take is None else np.ascontiguousarray(take(data))
                            w.write(name, cast(part, ref.dtype, out_dtype[n]))
                            weight_map[name] = fname
                        del data
                        bar.update(1)
        if len(shards) > 1:
            write_json_atomic(os.path.join(tmp, "model.safetensors.index.json"),
                              {"metadata": {"total_size": total}, "weight_map": weight_map})
        notes = ()
        tokenizer = tokenizer or recorded_tokenizer(read_sidecar(ckpt_path))
        if tokenizer:
            cfg, note = export_tokenizer(tokenizer, tmp, cfg)
            notes = (note,)
        write_json_atomic(os.path.join(tmp, "config.json"), msllm_config_to_hf(cfg, config_dtype))
        write_json_atomic(os.path.join(tmp, "generation_config.json"),
                          {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                           "pad_token_id": cfg.pad_token_id})
        if before_publish is not None:
            before_publish(tmp, cfg)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConversionResult(out_dir, cfg, len(weights), total, sorted(counts), "msllm", notes)


def read_hf_tensors(hf_dir: str) -> dict[str, np.ndarray]:
    """All weights of an HF directory as ``{HF name: storage array}`` (tests and small models)."""
    src = open_hf_source(hf_dir)
    try:
        return {msllm_to_hf_name(n): ref.load() for n, ref in src.params.items()}
    finally:
        src.close()


def read_msllm_tensors(ckpt_path: str) -> dict[str, tuple[np.ndarray, str]]:
    """All entries of an msllm ``.ckpt`` that are numeric tensors: ``{name: (storage array, dtype)}``."""
    return {n: (r.load(), r.dtype) for n, r in scan_checkpoint(ckpt_path).items() if r.dtype in STORAGE}


__all__ = ["ConversionResult", "convert_hf_to_msllm", "convert_msllm_to_hf", "msllm_model_config", "msllm_weights",
           "parse_size", "plan_shards", "read_hf_tensors", "read_msllm_tensors"]
