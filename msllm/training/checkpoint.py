"""Checkpoints of a run: atomic save with manifest, retention, choosing what to load or resume
from, and loading into a network.

Layout (MindFormers-compatible): ``{output_dir}/checkpoint/rank_{r}/{prefix}_{r}-{epoch}_{step}.ckpt``
(or ``.safetensors``), each with its manifest ``X.ckpt.json`` (:mod:`msllm.formats.manifest`). A
checkpoint of the train step holds the network parameters, the optimizer moments (``adam_m.*``,
``adam_v.*``), ``global_step`` and ``loss_scale``, plus ``epoch_num`` / ``step_num`` entries, so
it is enough to resume.

Safety rules (README "What msllm guarantees on failure"):

* a checkpoint whose manifest disagrees with it (truncated, bit-flipped, replaced) is never
  loaded and never overwritten; retention does not delete it either (it is evidence);
* among a directory's checkpoints the newest *good* one (manifest matches) is used; newer
  unusable ones are named in a warning;
* a checkpoint without a manifest (MindFormers, a conversion elsewhere) is used only when no good
  one exists, with a warning that it is unverified;
* checkpoints present but none usable: one :class:`MsllmError` naming each file and why; no
  checkpoint at all: ``resolve_checkpoint`` fails, :func:`find_resume_checkpoint` returns None
  (the run starts fresh; the caller logs it).
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Callable, Optional

from msllm.errors import MsllmError
from msllm.fileio import atomic_path
from msllm.formats.manifest import (CORRUPT, GOOD, UNVERIFIED, checkpoint_files, checkpoint_name,
                                    checkpoint_status, checkpoint_step, file_sha256, parse_checkpoint_name, read_sidecar,
                                    sidecar_path, verify_checkpoint, write_sidecar)
from msllm.formats.mindformers import has_fused, split_fused_params, to_msllm_names

log = logging.getLogger("msllm")

# Re-exported: callers use these through this module.
__all__ = ["rank_dir", "checkpoint_name", "list_checkpoints", "sidecar_path", "file_sha256", "write_sidecar",
           "read_sidecar", "verify_checkpoint", "save_checkpoint", "good_checkpoints", "prune_checkpoints",
           "checkpoint_search_dir", "resolve_checkpoint", "find_resume_checkpoint", "load_params", "load_into",
           "load_into_strict_after_compile"]

COUNTER_ENTRIES = ("epoch_num", "step_num")


def rank_dir(output_dir: str, rank: int) -> str:
    """``{output_dir}/checkpoint/rank_{rank}``."""
    return os.path.join(output_dir, "checkpoint", f"rank_{rank}")


def list_checkpoints(directory: str, prefix: Optional[str] = None) -> list[str]:
    """Checkpoints in ``directory`` named by :func:`checkpoint_name` (optionally of ``prefix``),
    oldest step first."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "*")):
        parsed = parse_checkpoint_name(path)
        if parsed and (prefix is None or parsed["prefix"] == prefix):
            found.append((parsed["step"], path))
    return [p for _, p in sorted(found)]


def save_checkpoint(cell, path: str, epoch: int, step: int, fmt: str = "ckpt", model_config=None,
                    **extra) -> str:
    """Save every parameter of ``cell`` to ``path`` atomically, then its manifest; returns ``path``.

    The checkpoint is written under a temporary name and renamed; the manifest (size, SHA-256,
    model config, epoch, step, and ``extra`` such as the prompt ``template`` the data was built
    with) is written after the rename, so a checkpoint with a matching manifest is known to be
    complete. Extra entries ``epoch_num`` and ``step_num`` (int) are stored with the parameters, as
    MindFormers does.

    Raises:
        MsllmError: ``path`` exists and its manifest disagrees with it: that file is evidence
            of corruption (or of another run's data) and is not overwritten.
    """
    import mindspore as ms

    if os.path.exists(path) or os.path.exists(sidecar_path(path)):
        status, reason = checkpoint_status(path)
        if status == CORRUPT:
            raise MsllmError(f"refusing to overwrite checkpoint {path}: it does not match its manifest "
                             f"{sidecar_path(path)} ({reason}); move it away (or delete it) to save this step")
    with atomic_path(path) as tmp:
        ms.save_checkpoint(cell, tmp, append_dict={"epoch_num": epoch, "step_num": step}, format=fmt)
    write_sidecar(path, model_config, epoch=epoch, step=step, **extra)
    return path


def _classify(paths: list[str], full: bool = True) -> tuple[dict, dict, dict]:
    """(good, unverified, corrupt): ``{path: reason}`` dicts (good: reason None), in ``paths`` order."""
    groups: dict[str, dict] = {GOOD: {}, UNVERIFIED: {}, CORRUPT: {}}
    for path in paths:
        status, reason = checkpoint_status(path, full)
        groups[status][path] = reason
    return groups[GOOD], groups[UNVERIFIED], groups[CORRUPT]


def good_checkpoints(directory: str, prefix: Optional[str] = None, full: bool = True) -> dict[int, str]:
    """``{step: path}`` of the checkpoints in ``directory`` whose manifest matches them
    (``full=False`` compares sizes only, for the frequent retention check).

    Each unusable checkpoint newer than the newest good one is named in a warning, with the good
    one that will be used instead.
    """
    paths = list_checkpoints(directory, prefix)
    good, unverified, corrupt = _classify(paths, full)
    steps = {checkpoint_step(p): p for p in good}
    newest_good = max(steps) if steps else -1
    for path, reason in {**unverified, **corrupt}.items():
        if checkpoint_step(path) > newest_good:
            log.warning("checkpoint %s is not usable (%s); using %s instead", path, reason,
                        steps[newest_good] if steps else "no checkpoint")
    return steps


def prune_checkpoints(directory: str, prefix: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` (>= 1) good checkpoints of ``prefix``; delete older ones (good,
    or without a manifest). The newest good checkpoint is never deleted, nothing newer than it is
    touched (it may be being written), and a checkpoint whose manifest disagrees with it is
    never deleted (each file about to be deleted is hashed first: one extra read of an old
    checkpoint per prune). Returns the deleted paths."""
    keep = max(1, keep)
    good = good_checkpoints(directory, prefix, full=False)
    if not good:
        return []
    oldest_kept = sorted(good)[-keep:][0]
    doomed = [p for p in list_checkpoints(directory, prefix)
              if checkpoint_step(p) < oldest_kept and checkpoint_status(p)[0] != CORRUPT]
    for p in doomed:
        os.remove(p)
        if os.path.exists(sidecar_path(p)):
            os.remove(sidecar_path(p))
    return doomed


def checkpoint_search_dir(path: str, rank: int) -> Optional[str]:
    """The directory holding rank ``rank``'s checkpoints for a ``load_checkpoint`` value: the
    directory of a file, ``path/rank_{r}``, ``path/checkpoint/rank_{r}``, or ``path`` itself
    (the first that holds checkpoint files); None if none does."""
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    for directory in (os.path.join(path, f"rank_{rank}"), os.path.join(path, "checkpoint", f"rank_{rank}"), path):
        if os.path.isdir(directory) and checkpoint_files(directory):
            return directory
    return None


def _none_usable(what: str, bad: dict) -> MsllmError:
    listing = "; ".join(f"{p}: {reason}" for p, reason in bad.items())
    return MsllmError(f"{what}: no usable checkpoint; every one found is unusable: {listing}. "
                      "Checkpoints that do not match their manifest are never loaded or overwritten: "
                      "move them away to start fresh")


def _choose(paths: list[str], what: str) -> str:
    """The newest good one of ``paths`` (oldest first), else the newest unverified one (warned),
    else MsllmError naming every file and why."""
    good, unverified, corrupt = _classify(paths)
    chosen = list(good)[-1] if good else (list(unverified)[-1] if unverified else None)
    if chosen is None:
        raise _none_usable(what, corrupt)
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


def find_resume_checkpoint(source: str, rank: int,
                           common_max: Callable[[list[int]], Optional[int]]) -> Optional[tuple[str, int]]:
    """The checkpoint to resume from: ``(path, step)`` of the newest step usable on every rank.

    Args:
        source: ``load_checkpoint`` if set, else ``{output_dir}/checkpoint`` (a file or a
            directory, searched by :func:`checkpoint_search_dir`).
        rank: this process's rank.
        common_max: ``steps -> the largest step present on every rank, or None`` (a collective:
            every rank calls it exactly once; ``RankAgreement.common_max`` in the trainer, or
            ``lambda s: max(s, default=None)`` for one process).

    Usable steps are those of checkpoints named ``{prefix}_{rank}-{epoch}_{step}`` whose manifest
    matches; when a rank has none, its checkpoints without a manifest count (warned unverified).

    Returns:
        None when this rank has no checkpoint at all (start fresh).

    Raises:
        MsllmError: checkpoints are present but none is usable (each named with the reason), or
            no step is usable on every rank.
    """
    problem = None
    if os.path.isfile(source):
        paths = [os.path.abspath(source)]
    else:
        directory = checkpoint_search_dir(source, rank) if os.path.exists(source) else None
        paths = checkpoint_files(directory) if directory else []
    unnamed = [p for p in paths if checkpoint_step(p) is None]
    if unnamed:
        problem = MsllmError(f"resume_training from {source!r}: {unnamed[0]} is not named "
                             "{prefix}_{rank}-{epoch}_{step}.ckpt, so its step is unknown; resume from a run's "
                             "checkpoint directory, or load it with resume_training: False")
        paths = []
    good, unverified, corrupt = _classify(paths)
    usable = good or unverified
    steps = {checkpoint_step(p): p for p in usable}
    step = common_max(sorted(steps))  # collective: every rank calls it once, before any error
    if problem is not None:
        raise problem
    if step is None:
        if not paths:
            return None
        if not usable:
            raise _none_usable(f"resume_training from {source!r} (rank {rank})", corrupt)
        raise MsllmError(f"resume_training from {source!r}: rank {rank} has usable checkpoints of steps "
                         f"{sorted(steps)} but no step is usable on every rank")
    chosen = steps[step]
    for path in paths[paths.index(chosen) + 1:]:
        log.warning("checkpoint %s is not usable on every rank (%s); resuming from %s", path,
                    corrupt.get(path) or unverified.get(path) or "a newer step missing on another rank", chosen)
    if chosen in unverified:
        log.warning("checkpoint %s has no manifest: resuming from it unverified", chosen)
    return chosen, step


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
    from msllm.config import from_dict
    from msllm.models.llama.config import LlamaConfig

    data = (read_sidecar(path) or {}).get("model_config")
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
