"""Per-parameter layouts of a parallel layout, computed offline from the rule table
(:func:`msllm.parallel.layout_rules.op_rules`) without building the network: device matrix,
tensor map, parallel-optimizer split, the AdamW moments, and each rank's slices and bytes.

Device matrix convention (MindSpore ``_rank_to_coordinate``: row-major, last axis fastest):
each pipeline stage owns ``dp * mp`` consecutive ranks, ``rank = stage * dp * mp + d * mp + m``;
the per-stage device matrix is ``[dp, mp]`` and a tensor map entry counts device-matrix axes from
the right: ``0`` = mp, ``1`` = dp, ``-1`` = not split. So tensor-parallel peers are neighbouring
ranks (one server), as in Megatron-LM.

Optimizer states and the parallel optimizer (what msllm chooses, following MindSpore):
AdamW's moments ``adam_m.{name}`` / ``adam_v.{name}`` always get the layout of their weight
(MindSpore clones the weight's layout for optimizer states), so checkpoints that hold them can
be resharded. With ``optimizer_shard`` (MindSpore ``enable_parallel_optimizer``, ZeRO stage 1
of Rajbhandari et al. 2020 in spirit, but MindSpore also stores the *weight* as the 1/N slice and
all-gathers it for the forward pass) a parameter is additionally split on its first axis over the
ranks that hold the same model-parallel slice, when MindSpore would do so
(``frontend/parallel/parallel_optimizer/opt_param_mgr.cc``): the parameter is not a norm weight
(MindFormers sets ``parallel_optimizer=False`` on RMSNorm weights;
:func:`msllm.parallel.apply.apply_layout` does the same, :func:`no_opt_shard_params`), its full
size is at least ``parallel_optimizer_threshold`` KB (64 by default, :data:`DEFAULT_OPT_THRESHOLD_KB`),
it is replicated on more than one rank of its stage, and its sliced first axis divides by that
count. That split is recorded as the strategy-file fields ``opt_weight_shard_size`` (ranks in the
group) and ``opt_weight_shard_step`` (rank distance between group members), exactly the fields
MindSpore writes when ``optimizer_weight_shard_aggregated_save`` is off
(``OperatorInfo::CreateGroupForOptShard``).
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Optional, Sequence

from msllm.models.llama.names import OPTIMIZER_STATE_PREFIXES, is_norm_weight, is_optimizer_state, param_shapes

PIPELINE_ACCU_PREFIX = "accu_grads."  # MindSpore's PipelineCell gradient accumulators
from msllm.parallel.layout_rules import OpRule, Sym, op_rules

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# MindSpore's default parallel_optimizer_threshold (KB); msllm.parallel.context sets exactly this.
DEFAULT_OPT_THRESHOLD_KB = 64


class ParamLayout(NamedTuple):
    """Where one parameter lives. The first four fields are the layout proper.

    dev_matrix: per-stage device matrix ``(dp, mp)``; experts' weights ``(ep, dp/ep, mp)``
        (the same ranks, the dp axis factored); axes of size 1 left out, as MindSpore writes them.
    tensor_map: per tensor axis, the device-matrix axis counted from the right (0 = mp, 1 = dp;
        experts: 0 = mp, 1 = dp/ep, 2 = ep) that splits it, -1 = not split.
    full_shape: the unsharded shape.
    stage: pipeline stage holding it (its ranks are ``stage*dp*mp .. (stage+1)*dp*mp - 1``).
    opt_shard_size / opt_shard_step: parallel-optimizer split of axis 0 (0 = none), MindSpore's
        ``opt_weight_shard_size`` / ``opt_weight_shard_step``.
    dtype: storage dtype name.
    """

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[int, ...]
    full_shape: tuple[int, ...]
    stage: int
    opt_shard_size: int = 0
    opt_shard_step: int = 0
    dtype: str = "float32"

    @property
    def mp_strategy(self) -> tuple[int, ...]:
        """Model-parallel split count per tensor axis (MindSpore ``_get_tensor_strategy``)."""
        n = len(self.dev_matrix)
        return tuple(1 if m == -1 else self.dev_matrix[n - 1 - m] for m in self.tensor_map)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """Shape of one rank's slice, after the model-parallel and optimizer splits."""
        shape = [s // k for s, k in zip(self.full_shape, self.mp_strategy)]
        if self.opt_shard_size > 0 and shape:
            shape[0] //= self.opt_shard_size
        return tuple(shape)

    @property
    def slice_numel(self) -> int:
        return math.prod(self.slice_shape)

    @property
    def slice_bytes(self) -> int:
        return self.slice_numel * DTYPE_BYTES[self.dtype]


_SYM_TO_AXIS = {"mp": 0, "dp": 1, None: -1}
# experts' weights: device matrix (ep, dp/ep, mp), the same ranks (rank = d * mp + m with
# d = e * dp/ep + r): an expert group is dp/ep consecutive data-parallel indices
_EXPERT_SYM_TO_AXIS = {"mp": 0, "dp/ep": 1, "ep": 2, None: -1}


def _tensor_map(sym: tuple[Sym, ...]) -> tuple[int, ...]:
    return tuple(_SYM_TO_AXIS[s] for s in sym)


def _expert_split(sym: tuple[Sym, ...]) -> bool:
    return "ep" in sym


def _without_unit_axes(dev_matrix: tuple[int, ...], tensor_map: tuple[int, ...]):
    """Drop the device-matrix axes of size 1 and renumber the tensor map, as MindSpore writes a
    layout into its strategy files (compiled by the dry-run: dp 1 x mp 2 gives ``[2]``, not
    ``[1, 2]``; expert_parallel = data_parallel gives the experts' ``[ep, mp]``). A tensor axis
    mapped to a dropped axis is not split (-1). All axes of size 1 leave ``(1,)``."""
    n = len(dev_matrix)
    kept = [i for i, d in enumerate(dev_matrix) if d > 1]         # indices from the left
    if not kept:
        return (1,), tuple(-1 for _ in tensor_map)
    new_right = {n - 1 - i: len(kept) - 1 - j for j, i in enumerate(kept)}  # old from-right -> new
    return tuple(dev_matrix[i] for i in kept), tuple(new_right.get(m, -1) for m in tensor_map)


def _layout_of(sym: tuple[Sym, ...], parallel_config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(device matrix, tensor map) of a parameter consumed with the symbolic split ``sym``, in
    MindSpore's form (:func:`_without_unit_axes`)."""
    pc = parallel_config
    if _expert_split(sym):
        ep = pc.expert_parallel
        return _without_unit_axes((ep, pc.data_parallel // ep, pc.model_parallel),
                                  tuple(_EXPERT_SYM_TO_AXIS[s] for s in sym))
    return _without_unit_axes((pc.data_parallel, pc.model_parallel), _tensor_map(sym))


def _opt_group(dev_matrix: Sequence[int], tensor_map: Sequence[int]) -> list[int]:
    """Ranks (within a stage) holding the same model-parallel slice as stage-local rank 0, in
    rank order: the parallel optimizer's group (MindSpore ``GetDevicesByTensorMap``)."""
    n = len(dev_matrix)
    used = {n - 1 - m for m in tensor_map if m != -1}
    ranks = []
    for r in range(math.prod(dev_matrix)):
        coord = _coordinate(r, dev_matrix)
        if all(coord[a] == 0 for a in used):
            ranks.append(r)
    return ranks


def _coordinate(rank: int, dev_matrix: Sequence[int]) -> list[int]:
    """Rank -> coordinate in the device matrix, last axis fastest (MindSpore ``_rank_to_coordinate``)."""
    coord = [0] * len(dev_matrix)
    for i in range(len(dev_matrix) - 1, -1, -1):
        coord[i] = rank % dev_matrix[i]
        rank //= dev_matrix[i]
    return coord


def param_layouts(model_config, parallel_config, stage_layers: Optional[Sequence[int]] = None,
                  include_optimizer_states: bool = True,
                  opt_threshold_kb: int = DEFAULT_OPT_THRESHOLD_KB) -> dict[str, ParamLayout]:
    """Per-parameter layout implied by :func:`~msllm.parallel.layout_rules.op_rules`, without building the network.

    Returns ``{name: ParamLayout(dev_matrix, tensor_map, full_shape, stage, opt_shard_size,
    opt_shard_step, dtype)}`` for every parameter of ``LlamaForCausalLM`` and, with
    ``include_optimizer_states``, ``adam_m.{name}`` / ``adam_v.{name}`` with the same layout
    (see the module docstring for the optimizer-shard rule). The layout is not validated here;
    call :func:`msllm.parallel.layout_checks.validate_layout` first.
    """
    shapes = param_shapes(model_config)
    out = layouts_from_rules(op_rules(model_config, parallel_config, stage_layers), shapes, parallel_config,
                             model_config.param_init_type, lambda name: not is_norm_weight(name),
                             include_optimizer_states=False, opt_threshold_kb=opt_threshold_kb)
    missing = set(shapes) - set(out)
    if missing:  # a parameter without a rule: the table and the model disagree
        raise AssertionError(f"no sharding rule consumes {sorted(missing)}")
    return with_optimizer_states(out, parallel_config.pipeline_stage > 1) if include_optimizer_states else out


def layouts_from_rules(rules: Iterable[OpRule], shapes: dict, parallel_config, dtype: str,
                       opt_shardable=lambda name: True, include_optimizer_states: bool = True,
                       opt_threshold_kb: int = DEFAULT_OPT_THRESHOLD_KB) -> dict[str, ParamLayout]:
    """``{name: ParamLayout}`` of the parameters that ``rules`` consume (full shapes from
    ``shapes``): the tensor map of the consuming input's strategy, and the parallel-optimizer
    split of the module docstring for parameters ``opt_shardable(name)`` allows. The one
    implementation behind :func:`param_layouts` (and layouts of added parameters, e.g. LoRA
    adapters)."""
    pc = parallel_config
    out: dict[str, ParamLayout] = {}
    for rule in rules:
        for idx, name in rule.params:
            dev, tmap = _layout_of(rule.in_strategy[idx], pc)
            shape = shapes[name]
            size = step = 0
            if pc.optimizer_shard and opt_shardable(name):
                group = _opt_group(dev, tmap)
                nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
                first = shape[0] // (1 if tmap[0] == -1 else dev[len(dev) - 1 - tmap[0]])
                if len(group) > 1 and nbytes >= opt_threshold_kb * 1024 and first % len(group) == 0:
                    size, step = len(group), (group[-1] - group[0]) // (len(group) - 1)
            out[name] = ParamLayout(dev, tmap, shape, rule.stage, size, step, dtype)
    return with_optimizer_states(out, parallel_config.pipeline_stage > 1) if include_optimizer_states else out


def with_optimizer_states(layouts: dict[str, ParamLayout], pipeline: bool = False) -> dict[str, ParamLayout]:
    """``layouts`` plus ``adam_m.{name}`` / ``adam_v.{name}`` with their weight's layout
    (MindSpore clones a weight's layout for its optimizer states), and with ``pipeline`` also
    ``accu_grads.{name}``: the gradient-accumulation buffers MindSpore's pipeline adds (seen in its
    own strategy files, compiled by the dry-run: same dev_matrix, tensor_map and opt-shard fields
    as the weight; issue #30)."""
    out = dict(layouts)
    prefixes = OPTIMIZER_STATE_PREFIXES + ((PIPELINE_ACCU_PREFIX,) if pipeline else ())
    for name, lay in layouts.items():
        for prefix in prefixes:
            out[prefix + name] = lay
    return out


def no_opt_shard_params(model_config) -> list[str]:
    """Parameters the parallel optimizer never splits (RMSNorm weights, as in MindFormers)."""
    return [n for n in param_shapes(model_config) if is_norm_weight(n)]


# ---------------------------------------------------------------------------------------------
# Slices (numpy), for checks and tools


def rank_slices(layout: ParamLayout, rank_in_stage: int) -> tuple[tuple[slice, ...], Optional[tuple[int, int]]]:
    """Index of one rank's slice: per-axis ``slice`` objects of the model-parallel split, and
    ``(index, count)`` of the optimizer split of axis 0 within that slice (or None)."""
    coord = _coordinate(rank_in_stage, layout.dev_matrix)
    n = len(layout.dev_matrix)
    index = []
    for size, m in zip(layout.full_shape, layout.tensor_map):
        if m == -1:
            index.append(slice(0, size))
            continue
        parts = layout.dev_matrix[n - 1 - m]
        k, chunk = coord[n - 1 - m], size // parts
        index.append(slice(k * chunk, (k + 1) * chunk))
    opt = None
    if layout.opt_shard_size > 0:
        group = [r for r in range(math.prod(layout.dev_matrix))
                 if all(_coordinate(r, layout.dev_matrix)[n - 1 - m] == coord[n - 1 - m]
                        for m in layout.tensor_map if m != -1)]
        opt = (group.index(rank_in_stage) % layout.opt_shard_size, layout.opt_shard_size)
    return tuple(index), opt


def slice_for_rank(full, layout: ParamLayout, rank_in_stage: int):
    """The part of ``full`` (a numpy array of ``layout.full_shape``) that rank
    ``rank_in_stage`` of the parameter's stage holds: model-parallel split per the tensor map,
    then the optimizer split of axis 0."""
    index, opt = rank_slices(layout, rank_in_stage)
    part = full[index]
    if opt is not None:
        k, count = opt
        chunk = part.shape[0] // count
        part = part[k * chunk:(k + 1) * chunk]
    return part


def stage_of_rank(rank: int, parallel_config) -> int:
    """Pipeline stage of a global rank: ``rank // (dp * mp)``."""
    return rank // (parallel_config.data_parallel * parallel_config.model_parallel)


def rank_param_bytes(layouts: dict[str, ParamLayout], rank: int, parallel_config) -> dict[str, int]:
    """Bytes one rank stores: ``{"weights", "optimizer_states", "total"}`` (slices per layout)."""
    stage = stage_of_rank(rank, parallel_config)
    weights = states = 0
    for name, lay in layouts.items():
        if lay.stage != stage or name.startswith(PIPELINE_ACCU_PREFIX):  # buffers, not stored state
            continue
        if is_optimizer_state(name):
            states += lay.slice_bytes
        else:
            weights += lay.slice_bytes
    return {"weights": weights, "optimizer_states": states, "total": weights + states}


__all__ = ["DEFAULT_OPT_THRESHOLD_KB", "DTYPE_BYTES", "ParamLayout", "layouts_from_rules", "no_opt_shard_params",
           "param_layouts", "rank_param_bytes", "rank_slices", "slice_for_rank", "stage_of_rank",
           "with_optimizer_states"]
