"""Merge a LoRA adapter into its base: ``W' = W + (lora_alpha / r) B A`` for each adapted module
(Hu et al. 2021 sec. 4.1: "we can explicitly compute and store W = W0 + BA"; PEFT
``LoraLayer.get_delta_weight`` = ``B @ A * scaling``). The result is an ordinary msllm checkpoint
that trains, predicts and converts to Hugging Face (``convert_weight.py --reversed``) like any other.

The base is read and the output written one tensor at a time (peak memory about one weight
matrix and its update in float64 over the baseline); the update is computed in float64 and
rounded once to the base tensor's dtype.
"""

from __future__ import annotations

import os
import numpy as np

from msllm.errors import MsllmError
from msllm.fileio import atomic_path, file_digest
from msllm.lora.targets import adapter_names


def merged_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """``w + scale * b @ a`` in float64, as float32. w (out, in), a (r, in), b (out, r)."""
    delta = (b.astype(np.float64) @ a.astype(np.float64)) * float(scale)
    return (w.astype(np.float64) + delta).astype(np.float32)


def merge_lora_checkpoint(base: str, adapter: str, output: str, progress: bool = False) -> dict:
    """Write ``base`` with ``adapter`` merged into ``output`` (a ``.ckpt``) and its manifest.

    Args:
        base: the base model (msllm / MindFormers checkpoint or HF directory) the adapter was
            trained on; its SHA-256 must match the adapter's record.
        adapter: an adapter checkpoint (:mod:`msllm.lora.adapter`).
        output: the merged ``.ckpt`` (written atomically; manifest ``output.json`` with
            ``model_config``, no ``pet_config`` key (the merged model has no adapters), and
            ``merged_from``: base identity, adapter path and SHA-256, rank, alpha, scale, modules).
        progress: a tqdm bar over tensors.

    Returns the manifest written. Raises MsllmError: base mismatch, an adapted module missing from
    the base, shapes that disagree, an output name not ending in ``.ckpt``.
    """
    from msllm.formats.dtypes import cast, to_float32
    from msllm.formats.manifest import write_sidecar
    from msllm.formats.mindspore_ckpt import CkptWriter, scan_checkpoint
    from msllm.lora.adapter import model_config_of, pet_config_of, read_adapter_manifest
    from msllm.convert.starting import check_same_base, open_base
    from msllm.config_lora import lora_scale

    if not output.endswith(".ckpt"):
        raise MsllmError(f"--output {output!r}: expected a file name ending in .ckpt")
    manifest = read_adapter_manifest(adapter)
    rec = manifest["lora"]
    pet = pet_config_of(manifest)
    scale = lora_scale(pet)
    identity = check_same_base(rec.get("base"), base, f"LoRA adapter {adapter}")
    adapter_refs = scan_checkpoint(adapter)
    src = open_base(base, model_config_of(manifest))
    try:
        cfg = src.config   # the base model's config: LoRA's settings are not the model's
        pairs = {}
        for module in rec["modules"]:
            a_name, b_name = adapter_names(module)
            w_name = f"{module}.weight"
            if w_name not in src.refs:
                raise MsllmError(f"LoRA adapter {adapter} adapts {module}, which base {base} does not have")
            if a_name not in adapter_refs or b_name not in adapter_refs:
                raise MsllmError(f"LoRA adapter {adapter} lacks {a_name if a_name not in adapter_refs else b_name}")
            out_f, in_f = src.refs[w_name].shape
            if adapter_refs[a_name].shape != (pet.lora_rank, in_f) or adapter_refs[b_name].shape != (out_f, pet.lora_rank):
                raise MsllmError(f"LoRA adapter {adapter}: {a_name} {list(adapter_refs[a_name].shape)} / {b_name} "
                                 f"{list(adapter_refs[b_name].shape)} do not fit {w_name} {[out_f, in_f]} at rank "
                                 f"{pet.lora_rank}")
            pairs[w_name] = (adapter_refs[a_name], adapter_refs[b_name])
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(src.refs), desc="merge LoRA", unit="tensor")
        dtypes = set()
        with atomic_path(output) as tmp:
            with CkptWriter(tmp) as writer:
                for name, ref in src.refs.items():
                    data = ref.load()
                    if name in pairs:
                        a, b = pairs[name]
                        merged = merged_weight(to_float32(data, ref.dtype), to_float32(a.load(), a.dtype),
                                               to_float32(b.load(), b.dtype), scale)
                        data = cast(merged, "float32", ref.dtype)
                    writer.write(name, data, ref.dtype)
                    dtypes.add(ref.dtype)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
    finally:
        src.close()
    merged_from = {"base": identity, "adapter": {"path": os.path.abspath(adapter), "sha256": file_digest(adapter)},
                   "lora_rank": pet.lora_rank, "lora_alpha": pet.lora_alpha, "scale": scale,
                   "modules": list(rec["modules"])}
    return write_sidecar(output, cfg, merged_from=merged_from,
                         dtype=sorted(dtypes)[0] if len(dtypes) == 1 else sorted(dtypes))


def merge_into_network(network) -> list[str]:
    """Fold every :class:`~msllm.lora.layer.LoRALinear` of ``network`` into its base weight in place
    (``W += scale * B A``, float64 then the weight's dtype) and zero B, so the network computes the
    same function with the update inside W. Returns the merged module names."""
    import mindspore as ms

    from msllm.lora.layer import LoRALinear

    done = []
    for name, cell in network.cells_and_names():
        if isinstance(cell, LoRALinear):
            w = cell.weight.asnumpy()
            merged = merged_weight(w.astype(np.float32), cell.lora_A.weight.asnumpy(), cell.lora_B.weight.asnumpy(),
                                   cell.scale)
            cell.weight.set_data(ms.Tensor(merged).astype(cell.weight.dtype))
            cell.lora_B.weight.set_data(ms.Tensor(np.zeros(cell.lora_B.weight.shape, np.float32)))
            done.append(name)
    return done


__all__ = ["merged_weight", "merge_lora_checkpoint", "merge_into_network"]
