"""Writing the parallel strategy files of an msllm layout, offline: what MindSpore would write
per rank in semi-auto parallel, produced from :func:`msllm.parallel.param_layout.param_layouts`
and :func:`msllm.parallel.layout_rules.op_rules` for any layout. The file format (protobuf
``.ckpt`` by default, JSON ``.json``), the file names and reading are
:mod:`msllm.parallel.strategy_files`.

Pipeline parallel (as MindSpore does it): each rank's file holds only its stage's parameters and
operators, ``"stage"`` of every strategy item is that stage, and the device matrix is the stage's
(``dp * mp`` ranks). ``mindspore.merge_pipeline_strategys(dir, merged)`` joins one file per stage
into a file whose parameter names are ``"{stage}-{name}"``; that merged file is what
``transform_checkpoints`` needs for a pipelined layout (:mod:`msllm.parallel.reshard` does it).

``OP_NAME`` (the keys of ``parallel_strategy_item``) is msllm's path of the primitive
(``model.layers.3.self_attn.q_proj.matmul``), not MindSpore's graph node name: the checkpoint
tools read only its ``stage``, but the files are not meant as ``strategy_ckpt_config["load_file"]``
for compilation (Ascend runs get their strategies from :func:`msllm.parallel.apply.apply_layout`).

Writing never builds the network or allocates weights: a 70B layout over 64 ranks takes about a
second on this 2-core machine (identical files within a stage are serialised once).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator, Optional, Sequence

from msllm.errors import MsllmError
from msllm.fileio import atomic_open
from msllm.parallel.layout_checks import validate_layout, validate_run_layout
from msllm.parallel.layout_rules import concrete, op_rules
from msllm.parallel.param_layout import ParamLayout, param_layouts, rank_param_bytes, stage_of_rank
from msllm.parallel.strategy_files import list_strategy_files, strategy_file_name, strategy_format, to_protobuf

SUMMARY_NAME = "layout_summary.yaml"


def stage_strategy(model_config, parallel_config, stage: int, layouts: dict[str, ParamLayout],
                   stage_layers: Optional[Sequence[int]] = None) -> dict:
    """The JSON strategy map of any rank of pipeline stage ``stage``."""
    dp, mp, ep = parallel_config.data_parallel, parallel_config.model_parallel, parallel_config.expert_parallel
    items = {}
    for rule in op_rules(model_config, parallel_config, stage_layers):
        if rule.stage == stage:
            items[rule.name] = {"stage": stage,
                                "parallel_strategy": [list(s) for s in concrete(rule.in_strategy, dp, mp, ep)]}
    layout_items = {}
    for name, lay in layouts.items():
        if lay.stage != stage:
            continue
        layout_items[name] = {"dev_matrix": list(lay.dev_matrix), "tensor_map": list(lay.tensor_map),
                              "tensor_shape": list(lay.full_shape), "field": 0,
                              "opt_weight_shard_step": lay.opt_shard_step,
                              # -1 = the whole repeat group, MindSpore's own entry under the
                              # optimizer_weight_shard_size -1 msllm sets (compiled by the dry-run,
                              # seed 13B job): msllm's optimizer shard always spans that group
                              "opt_weight_shard_size": -1 if lay.opt_shard_size > 0 else 0,
                              "param_split_shape": [], "indices_offset": []}
    return {"current_stage": stage, "parallel_strategy_item": items, "parallel_layout_item": layout_items}


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
        MsllmError: an invalid layout (:func:`~msllm.parallel.layout_checks.validate_layout`) or ``fmt`` not json/ckpt.
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


def save_strategy_for_run(run_config, stage_layers: Optional[Sequence[int]] = None, rank: Optional[int] = None,
                          extra_layouts: Optional[dict[str, ParamLayout]] = None) -> str:
    """The ``only_save_strategy: True`` path: validate the run's layout and write its strategy
    files to ``{output_dir}/strategy/`` (format per :func:`msllm.parallel.strategy_files.strategy_format`:
    protobuf ``.ckpt`` unless ``parallel.strategy_ckpt_save_file`` ends in ``.json``); returns
    that directory. No MindSpore context is set up and no weight is allocated, so it works on
    CPU for layouts CPU cannot train.

    ``rank``: ``None`` writes every rank's file (one process, offline); an int writes only that
    rank's (:func:`write_rank_strategy_file`): what a worker started by
    ``scripts/run_distribute.sh`` does (:mod:`msllm.cli` asks the launcher's environment).

    ``extra_layouts``: layouts of parameters the model gains outside the base rule table
    (LoRA adapters: :func:`msllm.lora.layout.lora_param_layouts`), written beside the base's.
    """
    validate_run_layout(run_config, stage_layers=stage_layers)
    layouts = None
    if extra_layouts:
        layouts = {**param_layouts(run_config.model_config, run_config.parallel_config, stage_layers),
                   **extra_layouts}
    out = os.path.join(os.path.abspath(run_config.output_dir), "strategy")
    fmt = strategy_format(run_config)
    if rank is None:
        write_strategy_files(run_config.model_config, run_config.parallel_config, out, stage_layers, fmt, layouts)
    else:
        write_rank_strategy_file(run_config.model_config, run_config.parallel_config, out, rank, stage_layers, fmt,
                                 layouts)
    return out


__all__ = ["SUMMARY_NAME", "atomic_dir", "save_strategy_for_run", "stage_strategy", "write_rank_strategy_file",
           "write_strategy_files"]
