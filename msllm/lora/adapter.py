"""Adapter checkpoints: the LoRA matrices (and, from training, their optimizer state and the step
counters) without the base weights, plus the base model's identity in the manifest.

File: an ordinary MindSpore checkpoint (``.ckpt`` or ``.safetensors``) holding
``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (float32), and from a train step also
``adam_m.<adapter>`` / ``adam_v.<adapter>``, ``global_step``, ``loss_scale``, ``epoch_num``,
``step_num``. No base weight is in it.

Manifest (``X.ckpt.json``, :mod:`msllm.formats.manifest` format ``msllm-ckpt-v1``): the usual keys
(``file``, ``size``, ``sha256``, ``model_config`` (the base model's), ``epoch``, ``step``), LoRA's
settings under ``"pet_config"`` (manifests written before that key kept them inside
``model_config``; both are read), plus ``"lora"``::

    {"format": "msllm-lora-v1",
     "pet_config": {"pet_type": "lora", "lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.05,
                    "target_modules": ".*wq|.*wv", "lora_a_init": "kaiming_uniform", "lora_b_init": "zeros"},
     "modules": ["model.layers.0.self_attn.q_proj", ...],      # the adapted modules, msllm names
     "base": {"path": "/abs/llama.ckpt", "sha256": "...", "kind": "checkpoint"} | null,
     "source": "msllm" | "peft"}

``base`` is null only for an adapter imported from PEFT without naming its base; every other
adapter is refused (one clear error) with a base whose SHA-256 differs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from msllm.errors import MsllmError
from msllm.fileio import atomic_path
from msllm.lora.targets import is_adapter_param

log = logging.getLogger("msllm")

LORA_FORMAT = "msllm-lora-v1"
STEP_ENTRIES = ("epoch_num", "step_num")


def lora_record(pet_config, modules, base: Optional[dict], source: str = "msllm") -> dict:
    """The manifest's ``"lora"`` value (see the module docstring)."""
    pc = pet_config if isinstance(pet_config, dict) else dataclasses.asdict(pet_config)
    return {"format": LORA_FORMAT, "pet_config": pc, "modules": list(modules), "base": base, "source": source}


def save_adapter_checkpoint(cell, network, path: str, record: dict, epoch: int = 0, step: int = 0,
                            fmt: str = "ckpt", model_config=None, **extra) -> str:
    """Save ``cell``'s parameters except ``network``'s frozen base weights to ``path``, atomically,
    then the manifest with ``record`` under ``"lora"``.

    Args:
        cell: what to save: the train step (adapters, their AdamW moments, ``global_step``,
            ``loss_scale``) or the network itself (adapters only).
        network: the LoRA network inside ``cell`` (its non-adapter parameters are left out).
        record: :func:`lora_record`.
        epoch, step: stored as ``epoch_num`` / ``step_num`` entries and in the manifest, as the
            trainer's full checkpoints do (``msllm.training.checkpoint.save_checkpoint``).
        model_config: the LlamaConfig (or dict) written to the manifest; LoRA's settings go to its
            ``"pet_config"`` key (from ``record``).
    Returns ``path``.
    """
    import mindspore as ms

    from msllm.formats.manifest import refuse_corrupt, write_sidecar

    if os.path.exists(path):  # as the trainer's save_checkpoint: a file that disagrees with its
        refuse_corrupt(path)  # manifest is evidence, never overwritten
    frozen = {p.name for p in network.get_parameters() if not is_adapter_param(p.name)}
    with atomic_path(path) as tmp:
        ms.save_checkpoint(cell, tmp, append_dict={"epoch_num": epoch, "step_num": step}, format=fmt,
                           choice_func=lambda name: name not in frozen)
    write_sidecar(path, model_config, record["pet_config"], epoch=epoch, step=step, lora=record, **extra)
    return path


def read_adapter_manifest(path: str) -> dict:
    """The manifest of adapter checkpoint ``path``, checked against the file.

    Raises MsllmError: file missing; no manifest; manifest that disagrees with the file (size or
    SHA-256); a model checkpoint rather than an adapter (no ``"lora"`` record).
    """
    from msllm.formats.manifest import CORRUPT, UNVERIFIED, checkpoint_status, read_sidecar, sidecar_path

    if not os.path.isfile(path):
        raise MsllmError(f"LoRA adapter {path}: file not found")
    status, reason = checkpoint_status(path)
    if status == UNVERIFIED:
        raise MsllmError(f"LoRA adapter {path} has no manifest {sidecar_path(path)}: msllm cannot tell its "
                         "settings and base model (adapters are written by msllm training, tools/merge_lora.py "
                         "or the PEFT import)")
    if status == CORRUPT:
        raise MsllmError(f"LoRA adapter {path} does not match its manifest {sidecar_path(path)}: {reason}")
    manifest = read_sidecar(path)
    rec = manifest.get("lora")
    if not isinstance(rec, dict) or rec.get("format") != LORA_FORMAT:
        raise MsllmError(f"{path} is not a LoRA adapter (its manifest has no {LORA_FORMAT!r} 'lora' record); "
                         "a full model checkpoint is a base model, not an adapter")
    return manifest


def pet_config_of(manifest: dict):
    """The :class:`~msllm.config_lora.PetConfig` recorded in an adapter manifest (its ``"lora"``
    record's)."""
    from msllm.config_lora import pet_config_from

    return pet_config_from(manifest["lora"]["pet_config"], "adapter manifest lora.pet_config")


def model_config_of(manifest: dict):
    """The base model's :class:`~msllm.models.llama.config.LlamaConfig` recorded in a manifest, or
    None if it records none (a ``pet_config`` inside it, as manifests written before LoRA's settings
    had their own key kept it, is dropped: :func:`msllm.formats.manifest.manifest_model_config`)."""
    from msllm.config_io import from_dict
    from msllm.formats.manifest import manifest_model_config
    from msllm.models.llama.config import LlamaConfig

    mc = manifest_model_config(manifest)
    if not mc:
        return None
    return from_dict(LlamaConfig, mc, "model_config")


def _check_entries(cell, params: dict, skip: set, path: str) -> None:
    for p in cell.get_parameters():
        if p.name in skip:
            continue
        if p.name not in params:
            raise MsllmError(f"LoRA adapter {path} lacks {p.name}")
        if tuple(params[p.name].shape) != tuple(p.shape):
            raise MsllmError(f"LoRA adapter {path}: {p.name} has shape {tuple(params[p.name].shape)}, the model "
                             f"expects {tuple(p.shape)} (another model shape or lora_rank?)")


def _read(path: str) -> dict:
    import mindspore as ms

    try:
        return ms.load_checkpoint(path, format="safetensors" if path.endswith(".safetensors") else "ckpt")
    except Exception as exc:  # MindSpore raises ValueError/RuntimeError with long texts
        raise MsllmError(f"LoRA adapter {path} cannot be read: {str(exc).splitlines()[0]}") from None


def load_adapter_into(network, adapter_ckpt: str, base_path: Optional[str] = None, rank: int = 0):
    """Add the LoRA adapter ``adapter_ckpt`` to ``network`` for inference (predict, chat, eval),
    without merging.

    ``network``: a ``LlamaForCausalLM`` whose base weights are already loaded from ``base_path``.
    The base's SHA-256 is compared with the adapter's record first (MsllmError on a mismatch);
    with ``base_path`` None, or an adapter that records no base, only names and shapes are checked
    (and a warning says so). Dropout is off. Returns the :class:`~msllm.lora.apply.LoraInfo`.
    """
    import mindspore as ms

    from msllm.lora.apply import apply_lora

    manifest = read_adapter_manifest(adapter_ckpt)
    rec = manifest["lora"]
    if base_path:
        from msllm.convert.starting import check_same_base

        check_same_base(rec.get("base"), base_path, f"LoRA adapter {adapter_ckpt}", rank)
    if not base_path or not rec.get("base"):
        log.warning("LoRA adapter %s: base model identity not checked (%s); names and shapes are", adapter_ckpt,
                    "no base path given" if not base_path else "the adapter records no base")
    info = apply_lora(network, pet_config_of(manifest), modules=rec["modules"], dropout=0.0)
    params = _read(adapter_ckpt)
    adapters = {k: v for k, v in params.items() if is_adapter_param(k)}
    extra = sorted(set(adapters) - set(info.adapter_params))
    if extra:
        raise MsllmError(f"LoRA adapter {adapter_ckpt} holds {extra[0]}, which its manifest's modules do not list")
    _check_entries(network, adapters, {p.name for p in network.get_parameters() if not is_adapter_param(p.name)},
                   adapter_ckpt)
    ms.load_param_into_net(network, adapters, strict_load=False)
    return info


def load_adapter_state(cell, network, adapter_ckpt: str, base_path: str, rank: int = 0) -> dict:
    """Resume: load adapter checkpoint ``adapter_ckpt`` (written by :func:`save_adapter_checkpoint`
    from the train step) into ``cell`` (the train step around ``network``, LoRA already applied,
    base weights loaded from ``base_path``).

    Every parameter of ``cell`` except the base weights must be in the file (adapters, their AdamW
    moments, ``global_step``, ``loss_scale``). Raises MsllmError if the base's SHA-256 differs
    from the adapter's record, or an entry is missing or mis-shaped. Returns the manifest.
    """
    import mindspore as ms

    from msllm.convert.starting import check_same_base

    manifest = read_adapter_manifest(adapter_ckpt)
    check_same_base(manifest["lora"].get("base"), base_path, f"LoRA checkpoint {adapter_ckpt}", rank)
    params = _read(adapter_ckpt)
    frozen = {p.name for p in network.get_parameters() if not is_adapter_param(p.name)}
    _check_entries(cell, params, frozen, adapter_ckpt)
    ms.load_param_into_net(cell, {k: v for k, v in params.items() if k not in STEP_ENTRIES}, strict_load=False)
    return manifest


__all__ = ["LORA_FORMAT", "lora_record", "save_adapter_checkpoint", "read_adapter_manifest", "pet_config_of",
           "model_config_of", "load_adapter_into", "load_adapter_state"]
