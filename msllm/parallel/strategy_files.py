"""MindSpore parallel strategy files: the format, their names, and reading them back.

A strategy file is what MindSpore writes per rank in semi-auto parallel
(``set_auto_parallel_context(strategy_ckpt_config={"save_file": ...})``); msllm writes the same
files offline from its layouts (:mod:`msllm.parallel.strategy`) and reads its own and MindSpore's
/ MindFormers' (:func:`read_strategy`, used by :mod:`msllm.parallel.reshard`).

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
``ckpt_strategy_rank_{i}.ckpt`` / ``.json`` (:func:`strategy_file_name`).

Pipeline parallel (as MindSpore does it): each rank's file holds only its stage's parameters and
operators, and ``"stage"`` of every strategy item is that stage (:func:`file_stage`).
``mindspore.merge_pipeline_strategys(dir, merged)`` joins one file per stage into a file whose
parameter names are ``"{stage}-{name}"``; :func:`read_strategy` reads both kinds.
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple, Optional, Sequence

from msllm.errors import MsllmError


def strategy_file_name(rank: int, fmt: str = "ckpt") -> str:
    """``ckpt_strategy_rank_{rank}.ckpt`` (MindSpore's protobuf) or ``.json``. MindSpore picks the
    parser by extension: only ``.json`` files are read as JSON."""
    return f"ckpt_strategy_rank_{rank}.{'json' if fmt == 'json' else 'ckpt'}"


def strategy_format(run_config) -> str:
    """``"json"`` if ``parallel.strategy_ckpt_save_file`` ends in ``.json``, else ``"ckpt"``
    (protobuf): MindSpore's rule, by extension. The files themselves are always
    ``{output_dir}/strategy/ckpt_strategy_rank_{i}.{ext}``, where MindFormers puts them."""
    return "json" if run_config.parallel.strategy_ckpt_save_file.endswith(".json") else "ckpt"


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


__all__ = ["StrategyRecord", "file_stage", "list_strategy_files", "load_strategy_map", "read_strategy",
           "strategy_file_name", "strategy_format", "to_protobuf"]
