"""Parallel strategy files: what MindSpore writes per rank in semi-auto parallel
(``set_auto_parallel_context(strategy_ckpt_config={"save_file": ...})``), produced here offline
from :func:`msllm.parallel.layout.param_layouts` for any layout, and read back.

Two encodings of one structure; MindSpore chooses the parser by file extension (``.json`` =
JSON, anything else = protobuf), and so does msllm:

* protobuf (the default, what MindFormers users have: ``output/strategy/ckpt_strategy_rank_{i}.ckpt``):
  ``ParallelStrategyMap`` of ``node_strategy.proto``, compiled in the MindSpore wheel as
  ``mindspore/train/node_strategy_pb2.py`` (package ``mindspore.straspb``): ``current_stage``,
  repeated ``parallel_strategy_item {node_name, parallel_strategys {stage, repeated
  parallel_strategy {repeated dim}}}``, repeated ``parallel_layout_item {param_name,
  parallel_layouts {repeated dev_matrix {dim}, repeated tensor_map {dim}, repeated
  param_split_shape {dim}, repeated indices_offset {dim}, field, opt_weight_shard_step,
  opt_weight_shard_size}}``. It has no full tensor shape.
* JSON (asked for with ``parallel.strategy_ckpt_save_file: *.json``), the one MindSpore's C++
  ``StrategyCheckpointInfo::to_json`` writes and ``mindspore.transform_checkpoints`` /
  ``merge_pipeline_strategys`` read::

    {"current_stage": S,
     "parallel_strategy_item": {OP_NAME: {"stage": S, "parallel_strategy": [[...], ...]}},
     "parallel_layout_item": {PARAM: {"dev_matrix": [dp, mp], "tensor_map": [...],
                                      "tensor_shape": [full shape], "field": 0,
                                      "opt_weight_shard_step": k, "opt_weight_shard_size": n,
                                      "param_split_shape": [], "indices_offset": []}}}

``tensor_map`` counts device-matrix axes from the right, -1 = not split. Files are named
``ckpt_strategy_rank_{i}.ckpt`` / ``.json``.

Pipeline parallel (as MindSpore does it): each rank's file holds only its stage's parameters and
operators, ``"stage"`` of every strategy item is that stage, and the device matrix is the stage's
(``dp * mp`` ranks). ``mindspore.merge_pipeline_strategys(dir, merged)`` joins one file per stage
into a file whose parameter names are ``"{stage}-{name}"``; that merged file is what
``transform_checkpoints`` needs for a pipelined layout (:mod:`msllm.parallel.reshard` does it).

``OP_NAME`` is msllm's path of the primitive (``model.layers.3.self_attn.q_proj.matmul``), not
MindSpore's graph node name: the checkpoint tools read only its ``stage``, but the files are not
meant as ``strategy_ckpt_config["load_file"]`` for compilation (Ascend runs get their strategies
from :func:`msllm.parallel.layout.apply_layout`).

Writing never builds the network or allocates weights: a 70B layout over 64 ranks takes about a
second on this 2-core machine (identical files within a stage are serialised once).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator, NamedTuple, Optional, Sequence

from msllm.errors import MsllmError
from msllm.fileio import atomic_open
from msllm.parallel.layout import (
    ParamLayout, concrete, op_rules, param_layouts, rank_param_bytes, stage_of_rank, strategy_file_name,
    strategy_format, validate_layout, validate_run_layout)

SUMMARY_NAME = "layout_summary.yaml"


def stage_strategy(model_config, parallel_config, stage: int, layouts: dict[str, ParamLayout],
                   stage_layers: Optional[Sequence[int]] = None) -> dict:
    """The JSON strategy map of any rank of pipeline stage ``stage``."""
    dp, mp = parallel_config.data_parallel, parallel_config.model_parallel
    items = {}
    for rule in op_rules(model_config, parallel_config, stage_layers):
        if rule.stage == stage:
            items[rule.name] = {"stage": stage,
                                "parallel_strategy": [list(s) for s in concrete(rule.in_strategy, dp, mp)]}
    layout_items = {}
    for name, lay in layouts.items():
        if lay.stage != stage:
            continue
        layout_items[name] = {"dev_matrix": list(lay.dev_matrix), "tensor_map": list(lay.tensor_map),
                              "tensor_shape": list(lay.full_shape), "field": 0,
                              "opt_weight_shard_step": lay.opt_shard_step,
                              "opt_weight_shard_size": lay.opt_shard_size,
                              "param_split_shape": [], "indices_offset": []}
    return {"current_stage": stage, "parallel_strategy_item": items, "parallel_layout_item": layout_items}


def to_protobuf(strategy: dict) -> bytes:
    """A strategy map (the JSON structure) as MindSpore's ``ParallelStrategyMap`` protobuf bytes."""
    from mindspore.train import node_strategy_pb2 as pb

    msg = pb.ParallelStrategyMap()
    msg.current_stage = strategy["current_stage"]
    for node, item in strategy["parallel_strategy_item"].items():
        it = msg.parallel_strategy_item.add()
        it.node_name = node
        it.parallel_strategys.stage = item["stage"]
        for dims in item["parallel_strategy"]:
            it.parallel_strategys.parallel_strategy.add().dim.extend(dims)
    for name, lay in strategy["parallel_layout_item"].items():
        it = msg.parallel_layout_item.add()
        it.param_name = name
        pl = it.parallel_layouts
        pl.dev_matrix.add().dim.extend(lay["dev_matrix"])
        pl.tensor_map.add().dim.extend(lay["tensor_map"])
        pl.param_split_shape.add().dim.extend(lay.get("param_split_shape", []))
        pl.indices_offset.add().dim.extend(lay.get("indices_offset", []))
        pl.field = lay.get("field", 0)
        pl.opt_weight_shard_step = lay.get("opt_weight_shard_step", 0)
        pl.opt_weight_shard_size = lay.get("opt_weight_shard_size", 0)
    return msg.SerializeToString()


@contextlib.contextmanager
def atomic_dir(path: str) -> Iterator[str]:
    """Yield a fresh temporary directory beside ``path``; on success it replaces ``path``
    (an existing ``path`` is moved aside and deleted after the rename), on error it is removed.
    Readers never see a half-written directory under ``path``."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        yield tmp
        old = None
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".old", dir=parent)
            os.rmdir(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _strategy_bytes(content: dict, fmt: str) -> bytes:
    return (json.dumps(content, separators=(",", ":")) + "\n").encode() if fmt == "json" else to_protobuf(content)


def _summary(parallel_config, layouts: dict, counts: list, fmt: str) -> dict:
    pc = parallel_config
    per_stage = pc.data_parallel * pc.model_parallel
    return {
        "layout": {"data_parallel": pc.data_parallel, "model_parallel": pc.model_parallel,
                   "pipeline_stage": pc.pipeline_stage, "optimizer_shard": pc.optimizer_shard,
                   "vocab_emb_dp": pc.vocab_emb_dp, "use_seq_parallel": pc.use_seq_parallel,
                   "device_num": pc.device_num, "layers_per_stage": counts},
        "format": fmt,
        # every rank of a stage holds the same amount (the splits are even)
        "rank_bytes_by_stage": {s: {"ranks": [s * per_stage, (s + 1) * per_stage - 1],
                                    **rank_param_bytes(layouts, s * per_stage, pc)}
                                for s in range(pc.pipeline_stage)},
    }


def _write_summary(path: str, summary: dict) -> None:
    import yaml

    with atomic_open(path) as fh:
        fh.write("# bytes one rank of each stage stores: parameter slices (weights) and AdamW moments\n")
        yaml.safe_dump(summary, fh, sort_keys=False)


def _check_fmt(fmt: str) -> None:
    if fmt not in ("json", "ckpt"):
        raise MsllmError(f"strategy format {fmt!r}: expected 'json' or 'ckpt' (protobuf)")


def write_strategy_files(model_config, parallel_config, out_dir: str,
                         stage_layers: Optional[Sequence[int]] = None, fmt: str = "ckpt",
                         layouts: Optional[dict[str, ParamLayout]] = None) -> list[str]:
    """Write ``{out_dir}/ckpt_strategy_rank_{i}.ckpt`` (MindSpore's protobuf; ``fmt="json"``:
    ``.json``) for every rank of the layout, plus ``layout_summary.yaml`` (layout, layers per
    stage, per-rank bytes). The directory is replaced atomically (one process: offline tools);
    for ranks of a running job writing into one directory use :func:`write_rank_strategy_file`.
    Returns the strategy file paths in rank order.

    Raises:
        MsllmError: an invalid layout (:func:`validate_layout`) or ``fmt`` not json/ckpt.
    """
    _check_fmt(fmt)
    counts = validate_layout(model_config, parallel_config, stage_layers=stage_layers)
    pc = parallel_config
    if layouts is None:
        layouts = param_layouts(model_config, pc, stage_layers)
    per_stage = pc.data_parallel * pc.model_parallel
    with atomic_dir(out_dir) as tmp:
        for stage in range(pc.pipeline_stage):
            data = _strategy_bytes(stage_strategy(model_config, pc, stage, layouts, stage_layers), fmt)
            for rank in range(stage * per_stage, (stage + 1) * per_stage):
                with open(os.path.join(tmp, strategy_file_name(rank, fmt)), "wb") as fh:
                    fh.write(data)
        _write_summary(os.path.join(tmp, SUMMARY_NAME), _summary(pc, layouts, counts, fmt))
    return [os.path.join(out_dir, strategy_file_name(r, fmt)) for r in range(pc.device_num)]


def write_rank_strategy_file(model_config, parallel_config, out_dir: str, rank: int,
                             stage_layers: Optional[Sequence[int]] = None, fmt: str = "ckpt",
                             layouts: Optional[dict[str, ParamLayout]] = None) -> str:
    """Write only rank ``rank``'s strategy file into ``out_dir`` (created if missing), as each
    rank of a job does: safe while the other ranks (and other servers, on a shared file system)
    write theirs into the same directory.

    The file is written under a hidden temporary name and renamed (atomic per file; the
    directory is never swapped). Rank ``rank``'s file of the other format is removed, so the
    directory holds one format. Rank 0 also writes ``layout_summary.yaml`` and removes strategy
    files of ranks the layout does not have (left by an earlier, larger layout); no rank of this
    layout writes those, so nothing races. Returns the file's path.

    Raises:
        MsllmError: invalid layout, ``fmt``, or a rank outside the layout.
    """
    _check_fmt(fmt)
    counts = validate_layout(model_config, parallel_config, stage_layers=stage_layers)
    pc = parallel_config
    if not 0 <= rank < pc.device_num:
        raise MsllmError(f"rank {rank} is outside the layout of {pc.device_num} rank(s) (data_parallel x "
                         f"model_parallel x pipeline_stage = {pc.data_parallel} x {pc.model_parallel} x "
                         f"{pc.pipeline_stage})")
    if layouts is None:
        layouts = param_layouts(model_config, pc, stage_layers)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, strategy_file_name(rank, fmt))
    with atomic_open(path, "wb", encoding=None) as fh:
        fh.write(_strategy_bytes(stage_strategy(model_config, pc, stage_of_rank(rank, pc), layouts, stage_layers), fmt))
    other = os.path.join(out_dir, strategy_file_name(rank, "json" if fmt == "ckpt" else "ckpt"))
    with contextlib.suppress(FileNotFoundError):
        os.remove(other)
    if rank == 0:
        _write_summary(os.path.join(out_dir, SUMMARY_NAME), _summary(pc, layouts, counts, fmt))
        for r, stale in list_strategy_files(out_dir).items():
            if r >= pc.device_num:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stale)
    return path


def save_strategy_for_run(run_config, stage_layers: Optional[Sequence[int]] = None, rank="launcher",
                          extra_layouts: Optional[dict[str, ParamLayout]] = None) -> str:
    """The ``only_save_strategy: True`` path: validate the run's layout and write its strategy
    files to ``{output_dir}/strategy/`` (format per :func:`msllm.parallel.layout.strategy_format`:
    protobuf ``.ckpt`` unless ``parallel.strategy_ckpt_save_file`` ends in ``.json``); returns
    that directory. No MindSpore context is set up and no weight is allocated, so it works on
    CPU for layouts CPU cannot train.

    ``rank``: ``None`` writes every rank's file (one process, offline); an int writes only that
    rank's (:func:`write_rank_strategy_file`); the default ``"launcher"`` reads the launcher's
    environment (:func:`msllm.cluster.context.launcher_role`): a worker started by
    ``scripts/run_distribute.sh`` writes only its own file, a scheduler process writes nothing,
    a process started by hand writes all.

    ``extra_layouts``: layouts of parameters the model gains outside this module's rule table
    (LoRA adapters: :func:`msllm.lora.layout.lora_param_layouts`), written beside the base's.
    """
    validate_run_layout(run_config, stage_layers=stage_layers)
    layouts = None
    if extra_layouts:
        layouts = {**param_layouts(run_config.model_config, run_config.parallel_config, stage_layers),
                   **extra_layouts}
    out = os.path.join(os.path.abspath(run_config.output_dir), "strategy")
    fmt = strategy_format(run_config)
    if rank == "launcher":
        from msllm.cluster.context import launcher_role

        role, rank = launcher_role()
        if role == "scheduler":
            return out
    if rank is None:
        write_strategy_files(run_config.model_config, run_config.parallel_config, out, stage_layers, fmt, layouts)
    else:
        write_rank_strategy_file(run_config.model_config, run_config.parallel_config, out, rank, stage_layers, fmt,
                                 layouts)
    return out


# ---------------------------------------------------------------------------------------------
# Reading


class StrategyRecord(NamedTuple):
    """One parameter of a strategy file: its layout fields and the stages holding it."""

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[int, ...]
    opt_shard_size: int
    opt_shard_step: int
    stages: tuple[int, ...]
    tensor_shape: Optional[tuple[int, ...]] = None

    @property
    def stage_device_num(self) -> int:
        n = 1
        for d in self.dev_matrix:
            n *= d
        return n

    def mp_strategy(self) -> tuple[int, ...]:
        n = len(self.dev_matrix)
        return tuple(1 if m == -1 else self.dev_matrix[n - 1 - m] for m in self.tensor_map)

    def slice_shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """Slice of ``full_shape`` one rank holds (``opt_shard_size`` -1 = the whole repeat group,
        MindSpore ``_extract_layout_item``)."""
        strat = self.mp_strategy()
        shape = [s // k for s, k in zip(full_shape, strat)]
        size = self.opt_shard_size
        if size == -1:
            prod = 1
            for k in strat:
                prod *= k
            size = self.stage_device_num // prod
        if size > 0 and shape:
            shape[0] //= size
        return tuple(shape)


def load_strategy_map(path: str) -> dict:
    """A strategy file (JSON, or protobuf by any other extension) as the JSON structure of the
    module docstring. Raises MsllmError naming the file if it is missing, empty or unparsable."""
    if not os.path.isfile(path):
        raise MsllmError(f"strategy file {path!r} does not exist")
    if os.path.getsize(path) == 0:
        raise MsllmError(f"strategy file {path!r} is empty")
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise MsllmError(f"strategy file {path!r} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or "parallel_layout_item" not in data:
            raise MsllmError(f"strategy file {path!r}: no 'parallel_layout_item' (not a MindSpore strategy file)")
        return data
    from mindspore.train import node_strategy_pb2 as pb

    msg = pb.ParallelStrategyMap()
    try:
        with open(path, "rb") as fh:
            msg.ParseFromString(fh.read())
    except Exception as exc:  # protobuf DecodeError
        raise MsllmError(f"strategy file {path!r} is neither JSON (.json) nor a MindSpore protobuf "
                         f"strategy: {exc}") from None
    data = {"current_stage": msg.current_stage, "parallel_strategy_item": {}, "parallel_layout_item": {}}
    for it in msg.parallel_strategy_item:
        data["parallel_strategy_item"][it.node_name] = {
            "stage": it.parallel_strategys.stage,
            "parallel_strategy": [list(s.dim) for s in it.parallel_strategys.parallel_strategy]}
    for it in msg.parallel_layout_item:
        pl = it.parallel_layouts
        data["parallel_layout_item"][it.param_name] = {
            "dev_matrix": list(pl.dev_matrix[0].dim), "tensor_map": list(pl.tensor_map[0].dim),
            "field": pl.field, "opt_weight_shard_step": pl.opt_weight_shard_step,
            "opt_weight_shard_size": pl.opt_weight_shard_size}
    return data


def file_stage(path: str) -> int:
    """The pipeline stage a per-rank strategy file belongs to (``stage`` of its first strategy
    item, as ``merge_pipeline_strategys`` reads it; 0 without items)."""
    items = load_strategy_map(path).get("parallel_strategy_item") or {}
    return int(next(iter(items.values()))["stage"]) if items else 0


def read_strategy(path: str) -> dict[str, StrategyRecord]:
    """Read a strategy file (JSON or protobuf; per-rank or merged) -> ``{name: StrategyRecord}``.

    Merged files name parameters ``"{stage}-{name}"``; records are keyed by the plain name and
    list every stage holding the parameter.
    """
    data = load_strategy_map(path)
    items = data.get("parallel_strategy_item") or {}
    default_stage = int(next(iter(items.values()))["stage"]) if items else 0
    out: dict[str, StrategyRecord] = {}
    for key, lay in data["parallel_layout_item"].items():
        name, stage = key, default_stage
        head, sep, tail = key.partition("-")
        if sep and head.isdigit():
            name, stage = tail, int(head)
        shape = tuple(lay["tensor_shape"]) if "tensor_shape" in lay else None
        prev = out.get(name)
        stages = tuple(sorted(set((prev.stages if prev else ()) + (stage,))))
        out[name] = StrategyRecord(tuple(lay["dev_matrix"]), tuple(lay["tensor_map"]),
                                   int(lay.get("opt_weight_shard_size", 0)), int(lay.get("opt_weight_shard_step", 0)),
                                   stages, shape)
    return out


def list_strategy_files(directory: str) -> dict[int, str]:
    """``{rank: path}`` of ``ckpt_strategy_rank_{i}.json|.ckpt`` files in ``directory``; any other
    ``*.json``/``*.ckpt`` files are listed under negative keys (merge_pipeline_strategys reads
    every such file); hidden files (temporary names of files being written) are skipped."""
    import re

    found: dict[int, str] = {}
    other = -1
    for fn in sorted(os.listdir(directory)):
        if not fn.endswith((".json", ".ckpt")) or fn.startswith("."):  # hidden: a file being written
            continue
        m = re.search(r"rank_(\d+)\.(json|ckpt)$", fn)
        if m:
            found[int(m.group(1))] = os.path.join(directory, fn)
        else:
            found[other] = os.path.join(directory, fn)
            other -= 1
    return found


__all__ = ["atomic_dir", "file_stage", "list_strategy_files", "read_strategy", "save_strategy_for_run",
           "write_rank_strategy_file",
           "stage_strategy", "StrategyRecord", "to_protobuf", "write_strategy_files", "stage_of_rank",
           "SUMMARY_NAME"]
