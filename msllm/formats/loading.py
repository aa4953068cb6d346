"""Which checkpoint file to load for a ``load_checkpoint`` path and a rank, and loading it into a
network: shared by training (finetune, resume), conversion checks, LoRA and inference, so none of
them imports another's package for it.

Safety rules (README "What msllm guarantees on failure"): a checkpoint whose manifest
(:mod:`msllm.formats.manifest`) disagrees with it is never loaded; among a directory's
checkpoints the newest *good* one is used, newer unusable ones are named in a warning; a
checkpoint without a manifest (MindFormers, a conversion elsewhere) is used only when no good one
exists, with a warning that it is unverified; checkpoints present but none usable: one
:class:`MsllmError` naming each file and why.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from msllm.errors import MsllmError
from msllm.formats.manifest import (CORRUPT, GOOD, UNVERIFIED, checkpoint_files, checkpoint_status, rank_dir,
                                    manifest_model_config, read_sidecar, sidecar_path)
from msllm.formats.mindformers import has_fused, split_fused_params, to_msllm_names

log = logging.getLogger("msllm")

# counters the trainer saves beside the weights; never loaded into a network
COUNTER_ENTRIES = ("epoch_num", "step_num")


def classify_checkpoints(paths: list[str], full: bool = True) -> tuple[dict, dict, dict]:
    """(good, unverified, corrupt): ``{path: reason}`` dicts (good: reason None), in ``paths`` order."""
    groups: dict[str, dict] = {GOOD: {}, UNVERIFIED: {}, CORRUPT: {}}
    for path in paths:
        status, reason = checkpoint_status(path, full)
        groups[status][path] = reason
    return groups[GOOD], groups[UNVERIFIED], groups[CORRUPT]


def checkpoint_search_dir(path: str, rank: int) -> Optional[str]:
    """The directory holding rank ``rank``'s checkpoints for a ``load_checkpoint`` value: the
    directory of a file, ``path/rank_{r}``, ``path/checkpoint/rank_{r}``, or ``path`` itself
    (the first that holds checkpoint files); None if none does."""
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    for directory in (os.path.join(path, f"rank_{rank}"), rank_dir(path, rank), path):
        if os.path.isdir(directory) and checkpoint_files(directory):
            return directory
    return None


def no_usable_checkpoint(what: str, bad: dict) -> MsllmError:
    listing = "; ".join(f"{p}: {reason}" for p, reason in bad.items())
    return MsllmError(f"{what}: no usable checkpoint; every one found is unusable: {listing}. "
                      "Checkpoints that do not match their manifest are never loaded or overwritten: "
                      "move them away to start fresh")


def _choose(paths: list[str], what: str) -> str:
    """The newest good one of ``paths`` (oldest first), else the newest unverified one (warned),
    else MsllmError naming every file and why."""
    good, unverified, corrupt = classify_checkpoints(paths)
    chosen = list(good)[-1] if good else (list(unverified)[-1] if unverified else None)
    if chosen is None:
        raise no_usable_checkpoint(what, corrupt)
    for path in paths[paths.index(chosen) + 1:]:
        log.warning("checkpoint %s is not usable (%s); using %s instead", path,
                    corrupt.get(path) or unverified.get(path), chosen)
    if chosen in unverified:
        log.warning("checkpoint %s has no manifest (written by another tool?): loading it unverified", chosen)
    return chosen


def resolve_checkpoint(path: str, rank: int) -> str:
    """The checkpoint file to load for ``load_checkpoint`` (finetune, predict, eval).

    A file: itself, unless it disagrees with its manifest (without one it is loaded with an
    "unverified" warning). A directory: per :func:`checkpoint_search_dir`, the newest good
    checkpoint, else the newest one without a manifest (warned).

    Raises:
        MsllmError: the path does not exist, holds no checkpoint for ``rank``, or holds only
            checkpoints that disagree with their manifests (each named with the reason).
    """
    if os.path.isfile(path):
        return _choose([path], f"load_checkpoint {path!r}")
    if not os.path.exists(path):
        raise MsllmError(f"load_checkpoint {path!r} does not exist")
    directory = checkpoint_search_dir(path, rank)
    if directory is None:
        raise MsllmError(f"load_checkpoint {path!r}: no checkpoint files (*.ckpt, *.safetensors) for rank "
                         f"{rank} found (looked in {path}/rank_{rank}, {path}/checkpoint/rank_{rank}, {path})")
    return _choose(checkpoint_files(directory), f"load_checkpoint {path!r} (rank {rank}, in {directory})")


def load_params(path: str, model_config=None) -> dict:
    """Read a checkpoint into ``{name: Parameter}`` under msllm names.

    Checkpoints in MindFormers' LLaMA naming (``model.layers.0.attention.wq.weight`` ...) are
    renamed (:func:`msllm.formats.mindformers.to_msllm_names`); their ``qkv_concat`` tensors are
    split with ``model_config`` (or the manifest's model config), else by :func:`load_into` with
    the network's config.

    Raises:
        MsllmError: naming the file if it disagrees with its manifest or is unreadable.
    """
    import mindspore as ms

    status, reason = checkpoint_status(path)
    if status == CORRUPT:
        raise MsllmError(f"checkpoint {path} does not match its manifest {sidecar_path(path)}: {reason}; "
                         "refusing to load it")
    fmt = "safetensors" if path.endswith(".safetensors") else "ckpt"
    try:
        params = ms.load_checkpoint(path, format=fmt)
    except Exception as exc:  # MindSpore raises ValueError/RuntimeError with long texts
        raise MsllmError(f"checkpoint {path!r} cannot be read: {str(exc).splitlines()[0]}") from None
    if model_config is None and has_fused(params) and status == GOOD:
        model_config = _manifest_model_config(path)
    return to_msllm_names(params, path, model_config)


def _manifest_model_config(path: str):
    from msllm.config_io import from_dict
    from msllm.models.llama.config import LlamaConfig

    data = manifest_model_config(read_sidecar(path))  # an older manifest's pet_config dropped
    return from_dict(LlamaConfig, data, "model_config") if data else None


def _network_config(cell):
    """The :class:`LlamaConfig` of the model inside ``cell`` (the cell itself or a wrapper)."""
    from msllm.models.llama.config import LlamaConfig

    for _, sub in cell.cells_and_names():
        cfg = getattr(sub, "config", None)
        if isinstance(cfg, LlamaConfig):
            return cfg
    return None


def _split_if_fused(cell, params: dict, path: str) -> dict:
    if not has_fused(params):
        return params
    cfg = _network_config(cell)
    if cfg is None:
        raise MsllmError(f"checkpoint {path} holds MindFormers qkv_concat tensors; splitting them needs the "
                         "model config (pass model_config to load_params)")
    return split_fused_params(params, cfg, path)


def load_into(cell, params: dict, path: str, strict: bool = True) -> list[str]:
    """Copy ``params`` into ``cell``'s parameters after checking names and shapes.

    MindFormers ``qkv_concat`` entries still in ``params`` are split with the network's config.
    Returns the names of ``cell``'s parameters not found in ``params`` (only when not strict).

    Raises:
        MsllmError: naming the file and the first mismatching parameter (shape or, with
            ``strict``, a network parameter missing from the file).
    """
    import mindspore as ms

    params = _split_if_fused(cell, params, path)
    missing = []
    for p in cell.get_parameters():
        src = params.get(p.name)
        if src is None:
            missing.append(p.name)
            continue
        if tuple(src.shape) != tuple(p.shape):
            raise MsllmError(f"checkpoint {path!r}: parameter {p.name} has shape {tuple(src.shape)}, "
                             f"the model built from the config expects {tuple(p.shape)}")
    if strict and missing:
        raise MsllmError(f"checkpoint {path!r} lacks {len(missing)} parameter(s) of the model, "
                         f"e.g. {missing[0]}")
    ms.load_param_into_net(cell, {k: v for k, v in params.items() if k not in COUNTER_ENTRIES},
                           strict_load=False)
    return missing


def load_into_strict_after_compile(network, params: dict, path: str) -> None:
    """Load ``params`` into a network whose parameters already have their per-rank (sharded)
    shapes, i.e. after the semi-auto-parallel train step was compiled (MindSpore's
    ``load_distributed_checkpoint`` flow); every network parameter must be loaded.

    Raises:
        MsllmError: naming the file and the parameters of ``network`` that the checkpoint lacks,
            whose shape differs from the compiled (sliced) shape, or that MindSpore did not load.
    """
    import mindspore as ms

    params = _split_if_fused(network, params, path)
    missing, wrong = [], []
    for p in network.get_parameters():
        src = params.get(p.name)
        if src is None:
            missing.append(p.name)
        elif tuple(src.shape) != tuple(p.shape):
            wrong.append(f"{p.name} {tuple(src.shape)} vs {tuple(p.shape)}")
    if missing:
        raise MsllmError(f"checkpoint {path!r} lacks {len(missing)} parameter(s) of the compiled network, "
                         f"e.g. {', '.join(missing[:3])}")
    if wrong:
        raise MsllmError(f"checkpoint {path!r}: {len(wrong)} parameter(s) differ from this rank's compiled shapes "
                         f"(checkpoint vs network), e.g. {'; '.join(wrong[:3])}: resharded for another layout?")
    result = ms.load_param_into_net(network, {k: v for k, v in params.items() if k not in COUNTER_ENTRIES},
                                    strict_load=False)
    not_loaded = list(result[0]) if isinstance(result, tuple) else list(result or [])
    if not_loaded:
        raise MsllmError(f"checkpoint {path!r}: MindSpore did not load {len(not_loaded)} parameter(s) of the "
                         f"network, e.g. {', '.join(not_loaded[:3])}")
