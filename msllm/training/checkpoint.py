"""Checkpoints of a run: atomic save with manifest, retention, choosing the step to resume from.
Choosing the file for ``load_checkpoint`` and loading it into a network live in
:mod:`msllm.formats.loading` (shared with conversion, LoRA and inference), re-exported here.

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
from msllm.formats.loading import (classify_checkpoints, no_usable_checkpoint, checkpoint_search_dir, load_into,
                                   load_into_strict_after_compile, load_params, resolve_checkpoint)
from msllm.formats.manifest import (CORRUPT, checkpoint_files, checkpoint_name, checkpoint_status, checkpoint_step,
                                    file_sha256, parse_checkpoint_name, rank_dir, read_sidecar, sidecar_path,
                                    verify_checkpoint, write_sidecar)

log = logging.getLogger("msllm")

# Re-exported: callers use these through this module.
__all__ = ["rank_dir", "checkpoint_name", "list_checkpoints", "sidecar_path", "file_sha256", "write_sidecar",
           "read_sidecar", "verify_checkpoint", "save_checkpoint", "good_checkpoints", "prune_checkpoints",
           "checkpoint_search_dir", "resolve_checkpoint", "find_resume_checkpoint", "load_params", "load_into",
           "load_into_strict_after_compile"]


def list_checkpoints(directory: str, prefix: Optional[str] = None) -> list[str]:
    """Checkpoints in ``directory`` named by :func:`checkpoint_name` (optionally of ``prefix``),
    oldest step first."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "*")):
        parsed = parse_checkpoint_name(path)
        if parsed and (prefix is None or parsed["prefix"] == prefix):
            found.append((parsed["step"], path))
    return [p for _, p in sorted(found)]


REFERENCE_PREFIX = "reference."   # names of a DPO reference model's frozen copies (msllm.training.dpo)


def check_only_reference_missing(missing: list, path: str) -> None:
    """After a non-strict load: MsllmError unless every parameter missing from checkpoint ``path`` is
    a DPO reference copy (not saved; reloaded from load_checkpoint)."""
    other = [n for n in missing if not n.startswith(REFERENCE_PREFIX)]
    if other:
        raise MsllmError(f"checkpoint {path!r} lacks {len(other)} parameter(s) of the model, e.g. {other[0]}")


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
        # a DPO reference's frozen copies (``reference.*``, msllm.training.dpo) are the starting
        # weights, reloaded from load_checkpoint on resume: not part of the run's state
        ms.save_checkpoint(cell, tmp, append_dict={"epoch_num": epoch, "step_num": step}, format=fmt,
                           choice_func=lambda name: not name.startswith(REFERENCE_PREFIX))
    write_sidecar(path, model_config, epoch=epoch, step=step, **extra)
    return path


def good_checkpoints(directory: str, prefix: Optional[str] = None, full: bool = True) -> dict[int, str]:
    """``{step: path}`` of the checkpoints in ``directory`` whose manifest matches them
    (``full=False`` compares sizes only, for the frequent retention check).

    Each unusable checkpoint newer than the newest good one is named in a warning, with the good
    one that will be used instead.
    """
    paths = list_checkpoints(directory, prefix)
    good, unverified, corrupt = classify_checkpoints(paths, full)
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


def find_resume_checkpoint(source: str, rank: int,
                           common_max: Callable[[list[int]], Optional[int]]) -> Optional[tuple[str, int]]:
    """The checkpoint to resume from: ``(path, step)`` of the newest step usable on every rank.

    Args:
        source: ``load_checkpoint`` if set, else ``{output_dir}/checkpoint`` (a file or a
            directory, searched by :func:`checkpoint_search_dir`).
        rank: this process's rank.
        common_max: ``steps -> the largest step present on every rank, or None`` (a collective:
            every rank calls it exactly once; ``RankAgreement.common_max`` (:mod:`msllm.training.control`), or
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
    good, unverified, corrupt = classify_checkpoints(paths)
    usable = good or unverified
    steps = {checkpoint_step(p): p for p in usable}
    step = common_max(sorted(steps))  # collective: every rank calls it once, before any error
    if problem is not None:
        raise problem
    if step is None:
        if not paths:
            return None
        if not usable:
            raise no_usable_checkpoint(f"resume_training from {source!r} (rank {rank})", corrupt)
        raise MsllmError(f"resume_training from {source!r}: rank {rank} has usable checkpoints of steps "
                         f"{sorted(steps)} but no step is usable on every rank")
    chosen = steps[step]
    for path in paths[paths.index(chosen) + 1:]:
        log.warning("checkpoint %s is not usable on every rank (%s); resuming from %s", path,
                    corrupt.get(path) or unverified.get(path) or "a newer step missing on another rank", chosen)
    if chosen in unverified:
        log.warning("checkpoint %s has no manifest: resuming from it unverified", chosen)
    return chosen, step


