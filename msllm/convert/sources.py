"""Reading a Hugging Face or Meta LLaMA checkpoint directory: its config, weight files, names and
shapes, with tensors loaded one at a time in HF layout.

* HF: ``config.json`` and the weights as ``model.safetensors`` / ``model-0000i-of-0000n.safetensors``
  + ``model.safetensors.index.json`` or ``pytorch_model.bin`` / ``pytorch_model-0000i-of-0000n.bin``
  + ``pytorch_model.bin.index.json`` (``transformers/modeling_utils.py`` ``save_pretrained``);
  weights of ``transformers/models/llama/modeling_llama.py``, q/k rows in the rotate_half layout.
* Meta: ``params.json`` + ``consolidated.NN.pth`` (``facebookresearch/llama``), q/k rows in the
  interleaved (complex-pair) rotary layout, converted with :func:`permute_meta_to_hf` exactly as
  ``permute`` in HF ``transformers/models/llama/convert_llama_weights_to_hf.py``.

Nothing but headers is read when a directory is opened; ``.bin``/``.pth`` go through
``torch.load(mmap=True, weights_only=True)`` (:mod:`msllm.formats.torch_weights`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from msllm.convert.configs import hf_config_to_msllm, meta_params_to_msllm, read_json
from msllm.errors import MsllmError
from msllm.formats.dtypes import FLOAT_DTYPES, OpenFiles, TensorRef
from msllm.formats.safetensors import safetensors_refs
from msllm.formats.torch_weights import torch_refs
from msllm.models.llama.config import LlamaConfig
from msllm.convert.experts import fuse_expert_refs
from msllm.models.llama.names import hf_to_msllm_name, param_shapes, translate_name

# HF tensors that are buffers, not weights (old transformers saved the rotary inverse frequencies).
HF_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
# Meta: the rotary table some consolidated checkpoints carry.
META_IGNORED = frozenset({"rope.freqs"})


# ---------------------------------------------------------------------------------------------
# Rotary layouts. Meta's ``apply_rotary_emb`` rotates adjacent pairs (x[2j], x[2j+1]) of each head;
# HF's rotate_half rotates (x[j], x[j + D/2]). Reordering the output rows of wq / wk per head
# turns one into the other without changing the function the attention computes.


def permute_meta_to_hf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Meta interleaved q/k rows -> HF rotate_half rows.

    ``w``: (n_heads * D, in) in any dtype; returns a new (n_heads * D, in) array whose head ``h``
    row ``j`` (j < D/2) is Meta row ``2j`` and row ``j + D/2`` is Meta row ``2j + 1``. Same as
    ``permute`` in HF ``transformers/models/llama/convert_llama_weights_to_hf.py``:
    ``w.view(n_heads, D // 2, 2, in).transpose(1, 2).reshape(n_heads * D, in)``.
    Use ``n_heads = num_key_value_heads`` for wk. Raises ValueError if the rows do not split.
    """
    rows, cols = w.shape
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    d = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, d // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


def permute_hf_to_meta(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`permute_meta_to_hf`: HF rotate_half rows -> Meta interleaved rows."""
    rows, cols = w.shape
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    d = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, d // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


# ---------------------------------------------------------------------------------------------
# Opening a directory.


@dataclass
class HFSource:
    """A LLaMA checkpoint directory ready to convert.

    kind: ``safetensors``, ``bin`` or ``meta``; config: the msllm config it describes;
    raw_config: ``config.json`` (or ``params.json``) as read; params: ``{msllm name: TensorRef}``
    in checkpoint order, validated against the config (names, shapes), loading HF-layout values;
    files: the weight files read.
    """

    directory: str
    kind: str
    config: LlamaConfig
    raw_config: dict
    params: dict
    files: list
    _files: OpenFiles = field(default_factory=OpenFiles, repr=False)

    def close(self) -> None:
        self._files.close()


def _weight_files(hf_dir: str) -> tuple[str, list[str], Optional[str]]:
    """(kind, files, index path) of the weights in ``hf_dir``, the way transformers picks them:
    safetensors before .bin, an index before a single file."""
    def p(name):
        return os.path.join(hf_dir, name)

    for kind, index, single, pattern in (
            ("safetensors", "model.safetensors.index.json", "model.safetensors", r".*\.safetensors$"),
            ("bin", "pytorch_model.bin.index.json", "pytorch_model.bin", r"^pytorch_model.*\.bin$")):
        if os.path.isfile(p(index)):
            data = read_json(p(index), "weight index")
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise MsllmError(f"{p(index)}: expected an object with a non-empty \"weight_map\"")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not isinstance(shard, str) or not os.path.isfile(p(shard)):
                    raise MsllmError(f"{p(index)} names shard {shard!r}, which is missing from {hf_dir}")
            return kind, [p(s) for s in shards], p(index)
        if os.path.isfile(p(single)):
            return kind, [p(single)], None
        found = sorted(f for f in os.listdir(hf_dir) if re.match(pattern, f))
        if found:
            return kind, [p(f) for f in found], None
    meta = sorted(f for f in os.listdir(hf_dir) if re.match(r"^consolidated\.\d+\.pth$", f))
    if meta:
        return "meta", [p(f) for f in meta], None
    raise MsllmError(f"{hf_dir}: no weights found (expected model.safetensors[.index.json], "
                     "pytorch_model.bin[.index.json], or consolidated.NN.pth with params.json)")


def _check_params(named: dict, cfg: LlamaConfig, where: str, naming: str) -> dict:
    """``named``: {msllm name: (source name, shape, file)} -> validated; MsllmError for a missing
    tensor or a shape that disagrees with ``where``'s config."""
    shapes = param_shapes(cfg)
    for msllm_name, (src_name, shape, path) in named.items():
        if msllm_name not in shapes and msllm_name != "lm_head.weight":  # tied: lm_head is ignored
            raise MsllmError(f"{path}: unknown tensor {src_name} (layer index >= num_layers="
                             f"{cfg.num_layers} of {where}?)")
    for msllm_name in shapes:  # model order, so the first mismatch reported is the earliest weight
        if msllm_name not in named:
            continue
        src_name, shape, path = named[msllm_name]
        if tuple(shape) != shapes[msllm_name]:
            raise MsllmError(f"{path}: tensor {src_name} has shape {list(shape)}, but {where} implies "
                             f"{list(shapes[msllm_name])}")
    missing = [n for n in shapes if n not in named]
    if missing:
        src = translate_name(missing[0], "msllm", naming) or missing[0]
        raise MsllmError(f"{os.path.dirname(where) or where}: {len(missing)} tensor(s) of the model are "
                         f"missing from the weights, e.g. {src}")
    return shapes


def open_hf_source(hf_dir: str) -> HFSource:
    """Inspect an HF (or Meta) checkpoint directory: config, weight files, names and shapes.

    Nothing but headers is read (tensor data is read later, one tensor at a time, by
    ``TensorRef.load``). Raises MsllmError naming the file / tensor / key for: a missing directory,
    missing or malformed ``config.json`` / index / ``params.json``, an unsupported architecture, a
    shard named by the index that is missing, a tensor the index puts in a shard that lacks it, a
    tensor twice, an unknown or missing tensor, a shape that disagrees with the config.
    """
    if not os.path.isdir(hf_dir):
        raise MsllmError(f"{hf_dir}: not a directory (expected an HF checkpoint directory)")
    kind, paths, index = _weight_files(hf_dir)
    if kind == "meta":
        return _open_meta(hf_dir, paths)
    cfg_path = os.path.join(hf_dir, "config.json")
    raw = read_json(cfg_path, "config.json (the HF model config)")
    cfg = hf_config_to_msllm(raw, cfg_path)
    files = OpenFiles()
    refs: dict[str, TensorRef] = {}
    try:
        for path in paths:
            for name, ref in (safetensors_refs(path, files) if kind == "safetensors" else torch_refs(path)).items():
                if name in refs:
                    raise MsllmError(f"{path}: tensor {name} is also in {refs[name].where}")
                refs[name] = ref
        if index is not None:
            for name, shard in read_json(index, "weight index")["weight_map"].items():
                ref = refs.get(name)
                if ref is None or os.path.basename(ref.where) != shard:
                    raise MsllmError(f"{index} puts tensor {name} in {shard}, which does not hold it")
        if cfg.moe_config is not None:  # per-expert file tensors -> msllm's fused ones (convert/experts.py)
            refs = fuse_expert_refs(refs, cfg.model_type, cfg.moe_config.expert_num)
        named, params = {}, {}
        for name, ref in refs.items():
            msllm_name = hf_to_msllm_name(name)
            if msllm_name is None:
                if HF_IGNORED.match(name):
                    continue
                raise MsllmError(f"{ref.where}: unknown tensor {name} (not a LlamaForCausalLM weight)")
            if ref.dtype not in FLOAT_DTYPES:
                raise MsllmError(f"{ref.where}: tensor {name} has dtype {ref.dtype}; expected a float tensor")
            named[msllm_name] = (name, ref.shape, ref.where)
            params[msllm_name] = ref
        shapes = _check_params(named, cfg, cfg_path, "hf")
    except BaseException:
        files.close()
        raise
    ordered = {n: params[n] for n in shapes}
    return HFSource(hf_dir, kind, cfg, raw, ordered, paths, files)


def _open_meta(hf_dir: str, paths: list[str]) -> HFSource:
    """Meta ``consolidated.NN.pth`` (+ ``params.json``): model-parallel shards are joined
    (column-parallel weights along rows, row-parallel ones and the LLaMA-1/2 embedding along
    columns, norms replicated; as HF ``convert_llama_weights_to_hf.py``), wq/wk permuted with
    :func:`permute_meta_to_hf`."""
    params_path = os.path.join(hf_dir, "params.json")
    raw = read_json(params_path, "params.json (the Meta model config)")
    shards = [torch_refs(p) for p in paths]
    names = list(shards[0])
    for p, refs in zip(paths, shards):
        if set(refs) != set(names):
            odd = sorted(set(refs) ^ set(names))[0]
            raise MsllmError(f"{p}: tensor {odd} is not in every consolidated.NN.pth shard")
    n = len(shards)

    def concat_axis(name: str, shape: tuple) -> Optional[int]:
        if n == 1 or len(shape) == 1:
            return None
        if name.startswith("tok_embeddings"):  # LLaMA-1/2 split the embedding by columns, LLaMA-3 by rows
            return 1 if shape[1] * n == raw.get("dim") else 0
        return 1 if re.search(r"(attention\.wo|feed_forward\.w2)\.weight$", name) else 0

    joined = {}
    for name in names:
        if name in META_IGNORED:
            continue
        parts = [refs[name] for refs in shards]
        axis = concat_axis(name, parts[0].shape)
        shape = list(parts[0].shape)
        if axis is not None:
            shape[axis] = sum(r.shape[axis] for r in parts)
        joined[name] = (parts, axis, tuple(shape))
    try:
        vocab = joined["tok_embeddings.weight"][2][0]
        ffn = joined["layers.0.feed_forward.w1.weight"][2][0]
    except KeyError as exc:
        raise MsllmError(f"{paths[0]}: tensor {exc.args[0]} is missing") from None
    cfg = meta_params_to_msllm(raw, params_path, vocab, ffn)
    named, params = {}, {}
    for name, (parts, axis, shape) in joined.items():
        msllm_name = translate_name(name, "meta", "msllm")
        if msllm_name is None:
            raise MsllmError(f"{parts[0].where}: unknown tensor {name} (not a Meta LLaMA weight)")
        heads = cfg.num_heads if ".wq." in name else cfg.kv_heads if ".wk." in name else None

        def load(parts=parts, axis=axis, heads=heads):
            arrays = [r.load() for r in parts]
            w = arrays[0] if axis is None else np.concatenate(arrays, axis=axis)
            return permute_meta_to_hf(w, heads) if heads else w

        named[msllm_name] = (name, shape, parts[0].where)
        params[msllm_name] = TensorRef(name, shape, parts[0].dtype, parts[0].where, load)
    shapes = _check_params(named, cfg, params_path, "meta")
    return HFSource(hf_dir, "meta", cfg, raw, {k: params[k] for k in shapes}, paths)


__all__ = ["HFSource", "open_hf_source", "permute_meta_to_hf", "permute_hf_to_meta"]
