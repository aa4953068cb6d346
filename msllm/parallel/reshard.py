"""Checkpoint resharding: full <-> sharded <-> differently sharded, wrapping MindSpore's
``transform_checkpoints`` (whole directories, offline: :func:`transform_checkpoints`) and
``transform_checkpoint_by_rank`` (one rank at start-up, ``auto_trans_ckpt: True``:
:func:`reshard_for_start`).

Inputs (rank checkpoints, strategy files or directories, MindFormers vs msllm parameter names)
are resolved and checked against each other first, by :mod:`msllm.parallel.reshard_inputs`. Output
ranks are ``rank_{i}/{prefix}{i}.ckpt`` (MindSpore's naming), written to a temporary directory
that is renamed onto the destination only when every rank is done.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional, Union

from msllm.errors import MsllmError
from msllm.fileio import atomic_path
from msllm.parallel.reshard_inputs import (align_strategy_naming, check_checkpoint_matches, check_dst_covers,
                                           checkpoint_names, collect_rank_checkpoints, resolve_strategy,
                                           strategy_shape)
from msllm.parallel.strategy import atomic_dir, write_strategy_files
from msllm.parallel.strategy_files import read_strategy


def _stage_ckpts(files: dict[int, str], root: str) -> str:
    """A directory ``root/rank_{i}/<file>`` of symlinks, so MindSpore sees one file per rank."""
    os.makedirs(root, exist_ok=True)
    for rank, path in files.items():
        d = os.path.join(root, f"rank_{rank}")
        os.makedirs(d, exist_ok=True)
        os.symlink(path, os.path.join(d, os.path.basename(path)))
    return root


def _check_prefix(prefix: str) -> None:
    if not prefix or "/" in prefix or prefix.startswith("."):
        raise MsllmError(f"prefix {prefix!r}: expected a file-name prefix such as 'checkpoint_'")


# ---------------------------------------------------------------------------------------------
# Whole directories


def transform_checkpoints(src_ckpt_dir: str, dst_ckpt_dir: str, src_strategy: Optional[str] = None,
                          dst_strategy: Optional[str] = None, prefix: str = "checkpoint_",
                          overwrite: bool = False) -> dict[int, str]:
    """Reshard every rank of a checkpoint: ``src_ckpt_dir`` (layout ``src_strategy``, None = full)
    -> ``dst_ckpt_dir/rank_{i}/{prefix}{i}.ckpt`` (layout ``dst_strategy``, None = full, one rank).

    Returns ``{rank: output file}``. The destination appears atomically; an existing non-empty
    destination is refused unless ``overwrite``.

    Raises:
        MsllmError: missing inputs, ranks missing for the source strategy, a checkpoint that does
            not match its strategy, or MindSpore failing (its message attached).
    """
    _check_prefix(prefix)
    if os.path.exists(dst_ckpt_dir) and os.listdir(dst_ckpt_dir) and not overwrite:
        raise MsllmError(f"dst_ckpt_dir {dst_ckpt_dir!r} exists and is not empty; remove it or pass overwrite")
    files = collect_rank_checkpoints(src_ckpt_dir)
    parent = os.path.dirname(os.path.abspath(dst_ckpt_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".reshard_work_", dir=parent)
    try:
        src_file = resolve_strategy(src_strategy, work, "src_strategy")
        dst_file = resolve_strategy(dst_strategy, work, "dst_strategy")
        names = checkpoint_names(files[min(files)])
        src_file = align_strategy_naming(src_file, names, work, "src_strategy")
        dst_file = align_strategy_naming(dst_file, names, work, "dst_strategy")
        src = read_strategy(src_file) if src_file else None
        dst = read_strategy(dst_file) if dst_file else None
        if src is None:
            if set(files) != {0}:
                raise MsllmError(f"src_ckpt_dir {src_ckpt_dir!r} holds ranks {sorted(files)} but no source strategy "
                                 "was given; a sharded checkpoint needs its strategy (--src_ckpt_strategy)")
            need = [0]
        else:
            per_stage, stages = strategy_shape(src)
            need = list(range(per_stage * stages))
            missing = sorted(set(need) - set(files))
            if missing:
                raise MsllmError(f"source strategy describes {len(need)} ranks ({stages} stage(s) x {per_stage}) but "
                                 f"src_ckpt_dir {src_ckpt_dir!r} lacks rank(s) {missing[:8]}"
                                 f"{' ...' if len(missing) > 8 else ''}")
            extra = sorted(set(files) - set(need))
            if extra:
                raise MsllmError(f"src_ckpt_dir {src_ckpt_dir!r} has rank(s) {extra[:8]} beyond the {len(need)} ranks "
                                 "of the source strategy: wrong strategy for this checkpoint")
        shapes0 = check_checkpoint_matches(files[need[0]], need[0], src)
        if dst is not None:
            check_dst_covers(dst, shapes0, src, str(dst_strategy))
        staged = _stage_ckpts({r: files[r] for r in need}, os.path.join(work, "src"))
        out_tmp = os.path.join(work, "out")
        import mindspore as ms

        try:
            ms.transform_checkpoints(staged, out_tmp, prefix, src_file, dst_file)
        except Exception as exc:
            raise MsllmError(f"mindspore.transform_checkpoints failed: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        per_stage_d, stages_d = strategy_shape(dst) if dst else (1, 1)
        written = collect_rank_checkpoints(out_tmp) if os.path.isdir(out_tmp) else {}
        if sorted(written) != list(range(per_stage_d * stages_d)):
            raise MsllmError(f"transform wrote ranks {sorted(written)}, expected 0..{per_stage_d * stages_d - 1}")
        with atomic_dir(dst_ckpt_dir) as tmp:
            os.rmdir(tmp)
            os.replace(out_tmp, tmp)
        return {r: os.path.join(os.path.abspath(dst_ckpt_dir), f"rank_{r}", os.path.basename(p))
                for r, p in written.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# One rank at start-up (auto_trans_ckpt)


def reshard_for_start(load_checkpoint: str, src_strategy: Optional[str], dst_layout: Union[str, object],
                      rank: int, work_dir: str, prefix: str = "checkpoint_",
                      stage_layers=None) -> str:
    """``auto_trans_ckpt: True``: produce this rank's slice of ``load_checkpoint`` for the layout
    it is about to train with; returns the path of a checkpoint to load into the sharded network.

    Args:
        load_checkpoint: a full checkpoint file, or a directory (``rank_{i}/*.ckpt``; a full
            checkpoint may also be ``DIR/rank_0/x.ckpt`` or ``DIR/x.ckpt``).
        src_strategy: strategy of ``load_checkpoint`` (file or directory); None/"" = full.
        dst_layout: the destination strategy (file or directory of per-rank files), or a
            :class:`RunConfig` whose model and ``parallel_config`` define it (strategy files are
            then written privately for this rank under ``work_dir``).
        rank: this process's global rank.
        work_dir: where to write; the result is ``{work_dir}/rank_{rank}/{prefix}{rank}.ckpt``.
        stage_layers: explicit layers per pipeline stage when ``dst_layout`` is a RunConfig.

    Only the source ranks this rank needs are read (``mindspore.rank_list_for_transform``), so
    every rank can run it concurrently; each rank writes only its own files. The output file is
    written under a temporary name and renamed.

    Raises:
        MsllmError: as :func:`transform_checkpoints`, plus a rank outside the destination layout.
    """
    import mindspore as ms

    _check_prefix(prefix)
    files = collect_rank_checkpoints(load_checkpoint)
    private = os.path.join(os.path.abspath(work_dir), f".rank_{rank}_work")
    shutil.rmtree(private, ignore_errors=True)
    os.makedirs(private)
    try:
        if isinstance(dst_layout, (str, os.PathLike)):
            dst_arg = str(dst_layout)
        else:
            from msllm.parallel.layout_checks import validate_run_layout

            cfg = dst_layout
            validate_run_layout(cfg, stage_layers=stage_layers)
            dst_arg = os.path.join(private, "dst_strategy")
            write_strategy_files(cfg.model_config, cfg.parallel_config, dst_arg, stage_layers)
        dst_file = resolve_strategy(dst_arg, private, "dst_strategy")
        src_file = resolve_strategy(src_strategy, private, "src_strategy")
        names = checkpoint_names(files[min(files)])
        src_file = align_strategy_naming(src_file, names, private, "src_strategy")
        dst_file = align_strategy_naming(dst_file, names, private, "dst_strategy")
        if dst_file is None:
            raise MsllmError("reshard_for_start needs a destination layout (dst_layout)")
        dst = read_strategy(dst_file)
        per_stage, stages = strategy_shape(dst)
        if not 0 <= rank < per_stage * stages:
            raise MsllmError(f"rank {rank} is outside the destination layout of {per_stage * stages} ranks")
        src = read_strategy(src_file) if src_file else None
        if src is None and set(files) != {0}:
            raise MsllmError(f"load_checkpoint {load_checkpoint!r} holds ranks {sorted(files)} but no source "
                             "strategy was given (src_strategy): a sharded checkpoint needs its strategy")
        needed = sorted(ms.rank_list_for_transform(rank, src_file, dst_file)) if src_file else [0]
        missing = [r for r in needed if r not in files]
        if missing:
            raise MsllmError(f"rank {rank} needs source rank(s) {missing} of {load_checkpoint!r}, which are missing")
        shapes = check_checkpoint_matches(files[needed[0]], needed[0], src)
        check_dst_covers(dst, shapes, src, dst_arg)
        out = os.path.join(os.path.abspath(work_dir), f"rank_{rank}", f"{prefix}{rank}.ckpt")
        with atomic_path(out) as tmp:
            try:
                ms.transform_checkpoint_by_rank(rank, {r: files[r] for r in needed}, tmp, src_file, dst_file)
            except Exception as exc:
                raise MsllmError(f"mindspore.transform_checkpoint_by_rank failed for rank {rank}: "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        return out
    finally:
        shutil.rmtree(private, ignore_errors=True)


def expected_rank_count(strategy: Optional[str]) -> int:
    """Ranks a strategy (file or directory) describes; 1 for None (full)."""
    if strategy is None or str(strategy).strip() == "":
        return 1
    work = tempfile.mkdtemp(prefix=".strategy_count_")
    try:
        f = resolve_strategy(strategy, work)
        per_stage, stages = strategy_shape(read_strategy(f))
        return per_stage * stages
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["expected_rank_count", "reshard_for_start", "transform_checkpoints"]
