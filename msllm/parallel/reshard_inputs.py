"""The inputs of a checkpoint reshard, found and checked before MindSpore runs: each rank's
checkpoint file, one strategy file per strategy argument, parameter naming aligned between the
two, and the checkpoint compared with its strategy. Used by :mod:`msllm.parallel.reshard`.

Conventions (MindSpore / MindFormers):
    * a checkpoint directory holds ``rank_{i}/*.ckpt``; when a rank directory holds several
      checkpoints, the newest msllm checkpoint (``{prefix}_{rank}-{epoch}_{step}.ckpt``, highest
      step) is used, otherwise the last name in lexical order (MindSpore's rule);
    * a strategy argument is ``None``/``""`` (the checkpoint is full, unsharded), a strategy file
      (per-rank or already merged), or a directory of per-rank strategy files. For a pipelined
      layout the per-rank files are merged with ``mindspore.merge_pipeline_strategys`` (one file
      per stage is enough); without pipelining any one rank's file describes the layout.

The source checkpoint of the first needed rank is compared with the source strategy (every
parameter the strategy lists for that rank's stage must be in the file with the slice shape the
strategy implies, :func:`check_checkpoint_matches`), and the destination strategy with the
checkpoint's parameters (:func:`check_dst_covers`), so a checkpoint/strategy mismatch is one clear
:class:`MsllmError` rather than a numpy error deep inside MindSpore.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
from typing import Optional

from msllm.errors import MsllmError
from msllm.formats.manifest import checkpoint_step, refuse_corrupt
from msllm.formats.mindformers import has_fused
from msllm.formats.mindspore_ckpt import scan_ckpt
from msllm.models.llama.names import (TRAINER_PREFIXES, is_mindformers_name, mindformers_to_msllm_name,
                                      msllm_to_mindformers_name, split_state_prefix)
from msllm.parallel.strategy_files import (StrategyRecord, file_stage, list_strategy_files, load_strategy_map,
                                           read_strategy, to_protobuf)


def collect_rank_checkpoints(ckpt: str) -> dict[int, str]:
    """``{rank: checkpoint file}`` from a file (rank 0, a full checkpoint), a directory of
    ``rank_{i}/`` subdirectories, or a directory holding ``*.ckpt`` directly (rank 0).

    Raises:
        MsllmError: nothing there, a rank directory without a checkpoint, or a chosen checkpoint
            whose manifest (``X.ckpt.json``) disagrees with it.
    """
    if os.path.isfile(ckpt):
        refuse_corrupt(ckpt)
        return {0: os.path.abspath(ckpt)}
    if not os.path.isdir(ckpt):
        raise MsllmError(f"checkpoint path {ckpt!r} does not exist")
    out: dict[int, str] = {}
    rank_dirs = [d for d in glob.glob(os.path.join(ckpt, "rank_*"))
                 if os.path.isdir(d) and d.rsplit("rank_", 1)[1].isdigit()]
    for d in rank_dirs:
        rank = int(d.rsplit("rank_", 1)[1])
        files = sorted(f for f in glob.glob(os.path.join(d, "*.ckpt")) if os.path.isfile(f))
        if not files:
            raise MsllmError(f"checkpoint directory {d!r} holds no *.ckpt file")
        out[rank] = os.path.abspath(newest(files))
    if not out:
        files = sorted(f for f in glob.glob(os.path.join(ckpt, "*.ckpt")) if os.path.isfile(f))
        if not files:
            if glob.glob(os.path.join(ckpt, "**", "*.safetensors"), recursive=True):
                raise MsllmError(f"{ckpt!r} holds safetensors checkpoints; msllm's reshard handles .ckpt only")
            raise MsllmError(f"checkpoint directory {ckpt!r} has neither rank_*/ subdirectories nor *.ckpt files")
        out[0] = os.path.abspath(newest(files))
    for path in out.values():  # a file that disagrees with its manifest is never used
        refuse_corrupt(path)
    return dict(sorted(out.items()))


def newest(files: list[str]) -> str:
    """Highest-step msllm checkpoint among ``files``, else the lexically last (MindSpore)."""
    steps = [(step, f) for f in files if (step := checkpoint_step(f)) is not None]
    return max(steps)[1] if steps else sorted(files)[-1]


def resolve_strategy(arg: Optional[str], work_dir: str, what: str = "strategy") -> Optional[str]:
    """A strategy argument -> one file MindSpore's transform functions can use (or None = full).

    A directory of per-rank files with one pipeline stage -> the lowest-rank file (all of its
    files must describe the same layout); with several stages -> merged into
    ``{work_dir}/merged_{what}.json|.ckpt`` by ``mindspore.merge_pipeline_strategys``.

    Raises:
        MsllmError: missing path, empty directory, mixed formats, missing stages or disagreeing
            per-rank files.
    """
    if arg is None or str(arg).strip() == "":
        return None
    if os.path.isfile(arg):
        read_strategy(arg)  # parse errors -> MsllmError
        return os.path.abspath(arg)
    if not os.path.isdir(arg):
        raise MsllmError(f"{what} {arg!r} does not exist (expected a strategy file or a directory of them)")
    files = list_strategy_files(arg)
    if not files:
        raise MsllmError(f"{what} directory {arg!r} holds no strategy files (*.json or *.ckpt)")
    exts = {os.path.splitext(p)[1] for p in files.values()}
    if len(exts) > 1:
        raise MsllmError(f"{what} directory {arg!r} mixes .json and .ckpt strategy files; keep one format")
    by_stage: dict[int, list[str]] = {}
    for path in files.values():
        by_stage.setdefault(file_stage(path), []).append(path)
    stages = sorted(by_stage)
    if stages != list(range(len(stages))):
        raise MsllmError(f"{what} directory {arg!r} has files of pipeline stages {stages}: stages "
                         f"{sorted(set(range(max(stages) + 1)) - set(stages))} are missing")
    for stage, paths in by_stage.items():
        first = read_strategy(paths[0])
        for p in paths[1:]:
            if read_strategy(p) != first:
                raise MsllmError(f"{what} files {paths[0]!r} and {p!r} are both stage {stage} but describe "
                                 "different layouts: they are from different runs")
    if len(stages) == 1:
        ranked = [r for r in files if r >= 0]
        return os.path.abspath(files[min(ranked)] if ranked else next(iter(files.values())))
    import mindspore as ms

    # merge_pipeline_strategys reads every *.json/*.ckpt of the directory: give it one file per stage
    src = tempfile.mkdtemp(prefix=f"{what}_stages_", dir=work_dir)
    for stage in stages:
        p = by_stage[stage][0]
        os.symlink(os.path.abspath(p), os.path.join(src, os.path.basename(p)))
    merged = os.path.join(work_dir, f"merged_{what}{exts.pop()}")
    ms.merge_pipeline_strategys(src, merged)
    return merged


def checkpoint_names(path: str) -> list[str]:
    """Entry names of a ``.ckpt`` (read from its framing, no tensor data)."""
    return list(scan_ckpt(path))


def align_strategy_naming(strategy_file: Optional[str], ckpt_names, work_dir: str, what: str) -> Optional[str]:
    """A strategy file whose parameter names use the checkpoint's naming: ``strategy_file`` itself,
    or a renamed copy in ``work_dir`` when one uses MindFormers' LLaMA names
    (``model.layers.0.attention.wq.weight``, as MindSpore writes strategies for MindFormers
    runs) and the other msllm's (:data:`msllm.models.llama.names.PARAM_TABLE`). The copy keeps
    the format (protobuf ``.ckpt`` or JSON) and every layout field.

    Raises:
        MsllmError: the checkpoint holds MindFormers ``qkv_concat`` tensors, which have no msllm
            layout to reshard to (reshard it to a full checkpoint first: no destination
            strategy; msllm then splits q/k/v when loading).
    """
    if strategy_file is None:
        return None
    data = load_strategy_map(strategy_file)
    layout_names = [k.partition("-")[2] if k.partition("-")[0].isdigit() else k for k in data["parallel_layout_item"]]
    ckpt_mf = any(is_mindformers_name(n) for n in ckpt_names)
    strategy_mf = any(is_mindformers_name(n) for n in layout_names)
    if ckpt_mf == strategy_mf:
        return strategy_file
    if has_fused(ckpt_names) or has_fused(layout_names):
        raise MsllmError(f"{what} {strategy_file!r}: the checkpoint holds MindFormers qkv_concat tensors "
                         "(w_qkv, w_gate_hidden), which msllm's layouts do not have; reshard it to a full "
                         "checkpoint first (empty --dst_ckpt_strategy) and load that")
    rename = mindformers_to_msllm_name if strategy_mf else msllm_to_mindformers_name

    def renamed(key: str) -> str:
        stage, sep, name = key.partition("-")
        if sep and stage.isdigit():
            return f"{stage}-{rename(name) or name}"
        return rename(key) or key

    data["parallel_layout_item"] = {renamed(k): v for k, v in data["parallel_layout_item"].items()}
    ext = ".json" if strategy_file.endswith(".json") else ".ckpt"
    out = os.path.join(work_dir, f"{what}_{'msllm' if strategy_mf else 'mindformers'}_names{ext}")
    with open(out, "wb") as fh:
        fh.write((json.dumps(data) + "\n").encode() if ext == ".json" else to_protobuf(data))
    return out


def strategy_shape(stra: dict[str, StrategyRecord]) -> tuple[int, int]:
    """(ranks per stage, stages) of a read strategy."""
    first = next(iter(stra.values()))
    stages = sorted({s for r in stra.values() for s in r.stages})
    return first.stage_device_num, len(stages)


def _param_shapes(path: str) -> dict[str, tuple[int, ...]]:
    import mindspore as ms

    try:
        params = ms.load_checkpoint(path)
    except Exception as exc:  # MindSpore raises ValueError/RuntimeError with long texts
        raise MsllmError(f"checkpoint {path!r} cannot be read: {str(exc).splitlines()[0]}") from None
    return {k: tuple(v.shape) for k, v in params.items()}


def check_checkpoint_matches(ckpt_file: str, rank: int, stra: Optional[dict[str, StrategyRecord]],
                             full_shapes: Optional[dict[str, tuple[int, ...]]] = None) -> dict[str, tuple]:
    """Check that ``ckpt_file`` is rank ``rank``'s slice under strategy ``stra`` (None = full).

    Every parameter the strategy places on the rank's stage must be in the file (optimizer
    moments may be absent: a weights-only checkpoint), and its shape
    must be the slice shape the strategy implies (from the strategy's ``tensor_shape`` or
    ``full_shapes``; when neither knows the full shape, the file's shape must at least be
    consistent: divisible back to an integral full shape). Returns the file's shapes.

    Raises:
        MsllmError: naming the file, the parameter, and the expected and found shapes.
    """
    shapes = _param_shapes(ckpt_file)
    if stra is None:
        return shapes
    _check_states_covered(shapes, stra, ckpt_file, "source")
    per_stage, _ = strategy_shape(stra)
    stage = rank // per_stage
    wanted = {n: r for n, r in stra.items() if stage in r.stages
              and (n in shapes or not n.startswith(TRAINER_PREFIXES))}  # states may be absent
    missing = [n for n in wanted if n not in shapes]
    if missing:
        raise MsllmError(f"checkpoint {ckpt_file!r} (rank {rank}) lacks {len(missing)} parameter(s) the source "
                         f"strategy places on its stage {stage}, e.g. {missing[0]!r}: the strategy does not "
                         "belong to this checkpoint")
    for name, rec in wanted.items():
        full = rec.tensor_shape or (full_shapes or {}).get(name)
        got = shapes[name]
        if full is not None:
            want = rec.slice_shape(full)
            if tuple(got) != tuple(want):
                raise MsllmError(f"checkpoint {ckpt_file!r} (rank {rank}): {name} has shape {tuple(got)}, the "
                                 f"source strategy implies the slice {want} of {tuple(full)}: wrong strategy "
                                 "for this checkpoint")
        elif len(got) != len(rec.tensor_map):
            raise MsllmError(f"checkpoint {ckpt_file!r} (rank {rank}): {name} has {len(got)} axes, the source "
                             f"strategy's tensor map {list(rec.tensor_map)} has {len(rec.tensor_map)}")
    return shapes


def _check_states_covered(names, stra: dict[str, StrategyRecord], where: str, which: str) -> None:
    """Optimizer moments of a sharded weight must be in the strategy too: MindSpore copies
    parameters a strategy does not list unchanged to every rank, which would leave full-size
    moments beside sliced weights."""
    for name in names:
        prefix, base = split_state_prefix(name)
        if prefix and base in stra and name not in stra:
            raise MsllmError(f"{where}: {name!r} is in the checkpoint but the {which} strategy lists only its "
                             f"weight {base!r}; use a strategy saved with optimizer states (msllm's strategy "
                             "files, or MindSpore's strategy_ckpt_config only_trainable_params=False)")


def check_dst_covers(dst: dict[str, StrategyRecord], ckpt_shapes: dict, src, dst_file: str) -> None:
    """Destination strategy vs the checkpoint's parameters: every destination parameter must exist
    in the source (else it is the strategy of another model; optimizer moments may be absent, a
    weights-only checkpoint), and full shapes must match and divide."""
    src_names = set(src) if src is not None else set(ckpt_shapes)
    _check_states_covered(ckpt_shapes, dst, f"destination strategy {dst_file!r}", "destination")
    # optimizer moments and MindSpore's pipeline accumulators (accu_grads.*) may be absent from a checkpoint
    unknown = [n for n in dst if n not in src_names and not n.startswith(TRAINER_PREFIXES)]
    if unknown:
        raise MsllmError(f"destination strategy {dst_file!r} lists {len(unknown)} parameter(s) the source "
                         f"checkpoint lacks, e.g. {unknown[0]!r}: it belongs to another model")
    for name, rec in dst.items():
        if name not in src_names:
            continue
        full = rec.tensor_shape or (src[name].tensor_shape if src is not None else ckpt_shapes.get(name))
        if full is None:
            continue
        if rec.tensor_shape and src is None and tuple(ckpt_shapes[name]) != tuple(rec.tensor_shape):
            raise MsllmError(f"destination strategy {dst_file!r}: {name} has full shape {list(rec.tensor_shape)}, "
                             f"the checkpoint's is {list(ckpt_shapes[name])}: different model shapes")
        strat = rec.mp_strategy()
        if any(s % k for s, k in zip(full, strat)):
            raise MsllmError(f"destination strategy {dst_file!r}: {name} of shape {list(full)} cannot be split "
                             f"{list(strat)} ways")


__all__ = ["align_strategy_naming", "check_checkpoint_matches", "check_dst_covers", "checkpoint_names",
           "collect_rank_checkpoints", "newest", "resolve_strategy", "strategy_shape"]
