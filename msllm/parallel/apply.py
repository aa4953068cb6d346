"""Applying a parallel layout to a built network: ``.shard()`` on every primitive of the rule
table, pipeline stages on cells, and activation recomputation.

The strategies come from :func:`msllm.parallel.layout_rules.op_rules` (the one rule table, also
behind the offline :func:`msllm.parallel.param_layout.param_layouts`); this module is the only
place that touches the network's cells for parallelism (torchtitan style: the model file
:mod:`msllm.models.llama.model` knows nothing of it). MindSpore reads the strategies in
SEMI_AUTO_PARALLEL (Ascend) and ignores them stand-alone; recomputation
(:func:`apply_recompute`) works in data_parallel mode too, CPU included.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from msllm.parallel.layout_rules import OpRule, cell_stages, concrete, op_rules
from msllm.parallel.param_layout import no_opt_shard_params


def _resolve(network, path: str):
    cell = network
    for part in path.split(".") if path else []:
        cell = cell[int(part)] if part.isdigit() else getattr(cell, part)
    return cell


def apply_layout(network, parallel_config, recompute_config=None,
                 stage_layers: Optional[Sequence[int]] = None, packed: bool = False) -> list[OpRule]:
    """Shard ``network`` (a :class:`LlamaForCausalLM`) per :func:`~msllm.parallel.layout_rules.op_rules`;
    set pipeline stages and recomputation. Returns the applied rules.

    * every rule's primitive gets ``prim.shard(in_strategy, out_strategy)`` (numbers from the
      symbols; MindSpore reads them in SEMI_AUTO_PARALLEL and ignores them stand-alone);
    * RMSNorm weights get ``parallel_optimizer = False``
      (:func:`~msllm.parallel.param_layout.no_opt_shard_params`, see :mod:`msllm.parallel.param_layout`);
    * with ``pipeline_stage > 1`` each cell of :func:`~msllm.parallel.layout_rules.cell_stages` gets
      ``cell.pipeline_stage``;
    * ``recompute_config.recompute``: each decoder layer ``recompute(mp_comm_recompute=...,
      parallel_optimizer_comm_recompute=..., recompute_slice_activation=...)`` (Chen et al. 2016;
      Korthikanti et al. 2022 "full" recomputation); ``select_recompute`` (and not ``recompute``):
      the attention core (BatchMatMul, scale, mask, Softmax) and the SwiGLU element-wise ops
      are recomputed (Korthikanti et al. 2022 sec. 5 "selective" recomputation, extended to the
      MLP activations as MindFormers' ``select_recompute`` does).

    ``packed``: the network will be fed packed rows (``actual_seq_len``; see ``op_rules``).

    The network must be the model the rules were derived from (``network.config``); a missing
    primitive or parameter raises AssertionError (the model and the table have drifted).
    """
    mc = network.config
    dp, mp, ep = parallel_config.data_parallel, parallel_config.model_parallel, parallel_config.expert_parallel
    rules = op_rules(mc, parallel_config, stage_layers, network.kernels, packed)
    for rule in rules:
        cell = _resolve(network, rule.path)
        prim = getattr(cell, rule.prim, None)
        if prim is None or not hasattr(prim, "shard"):
            raise AssertionError(f"layout rule {rule.name}: the network has no primitive there")
        prim.shard(concrete(rule.in_strategy, dp, mp, ep), concrete(rule.out_strategy, dp, mp, ep))
        for _, pname in rule.params:
            param = getattr(cell, pname.rsplit(".", 1)[1], None)
            if param is None or param.name != pname:
                raise AssertionError(f"layout rule {rule.name}: expected parameter {pname}")
    keep_whole = set(no_opt_shard_params(mc))
    for p in network.get_parameters():
        if p.name in keep_whole:
            p.parallel_optimizer = False
    if parallel_config.pipeline_stage > 1:
        for path, stage in cell_stages(mc, parallel_config, stage_layers).items():
            _resolve(network, path).pipeline_stage = stage
    apply_recompute(network, recompute_config, sharded=True)
    return rules


def apply_recompute(network, recompute_config, sharded: bool = False) -> int:
    """Mark activations of every decoder layer of ``network`` for recomputation in the backward
    pass (MindSpore ``Cell.recompute`` / ``Primitive.recompute``, graph mode); returns the number
    of layers marked (0 when the config asks for none).

    ``recompute``: whole layers (Chen et al. 2016; Korthikanti et al. 2022 "full" recomputation);
    with ``sharded`` (operator-sharded layouts) also the ``mp_comm_recompute``,
    ``parallel_optimizer_comm_recompute`` and ``recompute_slice_activation`` options, which concern
    the collectives those layouts insert. ``select_recompute`` (and not ``recompute``): the
    attention core (BatchMatMul, scale, mask, Softmax) and the SwiGLU element-wise ops only
    (Korthikanti et al. 2022 sec. 5 "selective" recomputation, extended to the MLP activations as
    MindFormers' ``select_recompute`` does). Works in data_parallel mode too (CPU included).
    """
    rc = recompute_config
    if rc is None or not (rc.recompute or rc.select_recompute):
        return 0
    for layer in network.model.layers:
        if rc.recompute:
            kwargs = {}
            if sharded:
                kwargs = {"mp_comm_recompute": rc.mp_comm_recompute,
                          "recompute_slice_activation": rc.recompute_slice_activation}
                if rc.parallel_optimizer_comm_recompute:
                    kwargs["parallel_optimizer_comm_recompute"] = True
            layer.recompute(**kwargs)
        else:
            for prim in _select_recompute_prims(layer):
                prim.recompute()
    return len(network.model.layers)


SELECT_RECOMPUTE = {"self_attn": ("bmm_qk", "mul_scale", "add_mask", "softmax", "bmm_pv"),
                    "mlp": ("sigmoid", "mul_silu", "mul")}


def _select_recompute_prims(layer) -> Iterable:
    for cell_name, prims in SELECT_RECOMPUTE.items():
        cell = getattr(layer, cell_name)
        for p in prims:
            yield getattr(cell, p)


def apply_data_parallel_moe(network, world_size: int) -> bool:
    """Data parallel over ``world_size`` > 1 processes (msllm's own gradient all-reduce): give a
    mixture-of-experts ``network`` a router-count all-reduce so that its load-balancing loss counts
    the global batch's routing (``LlamaForCausalLM.set_router_count_reducer``): the mean of the
    ranks' losses and gradients is then exactly one process's on the whole batch. Under operator
    sharding MindSpore's own reduction over the split batch axis does the same. Returns True when
    applied (a dense network, or one process, is left alone)."""
    if world_size <= 1 or not getattr(network, "moe_layers", 0):
        return False
    from mindspore import nn, ops

    class SumOverRanks(nn.Cell):
        """(E,) float32 -> its sum over the world group (AllReduce sum: works on CPU too)."""

        def __init__(self):
            super().__init__()
            self.all_reduce = ops.AllReduce()

        def construct(self, x):
            return self.all_reduce(x)

    network.set_router_count_reducer(SumOverRanks(), world_size)
    return True


__all__ = ["SELECT_RECOMPUTE", "apply_data_parallel_moe", "apply_layout", "apply_recompute"]
