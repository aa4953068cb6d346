"""Parallel layouts of the LoRA parameters and operators, derived from the base layer's rule in
:func:`msllm.parallel.layout_rules.op_rules` (Megatron-LM pattern, Shoeybi et al. 2019 sec. 3).

For a targeted linear layer with weight W (out, in) split ``(w_out, w_in)``:

* column-parallel base (q/k/v, gate/up; the head when vocab-parallel), W split on ``out``:
  B (out, r) is split by rows like W, A (r, in) is replicated. ``x A^T`` needs no communication;
  ``(x A^T) B_m^T`` is rank m's slice of the update, added to its slice of ``x W^T``.
* row-parallel base (o, down), W split on ``in``: A (r, in) is split by columns like W, B is
  replicated. ``x_m A_m^T`` are partial sums of the (N, r) product, summed (AllReduce over
  ``model_parallel`` ranks, r columns: far smaller than the base's (N, out) AllReduce), then
  ``B`` gives the full update, added to the reduced ``x W^T``.
* dropout on the adapter input and the scale multiply follow the input's split.

MindFormers shards its ``LoRADense`` the same way from the base MatMul's strategy
(``mindformers/pet/tuners/lora_adapter.py``, ``recursive_replace_dense_cell``, transpose_b case).

The optimizer-shard rule and the AdamW moments' layouts are those of
:func:`msllm.parallel.param_layout.param_layouts` (the same function,
:func:`~msllm.parallel.param_layout.layouts_from_rules`, computes both); adapters are float32 and
never norm weights, so every adapter may be optimizer-sharded.
"""

from __future__ import annotations

from typing import Optional, Sequence

from msllm.errors import MsllmError
from msllm.lora.targets import adapter_names, adapter_shapes, match_targets
from msllm.parallel.layout_rules import OpRule, concrete, op_rules
from msllm.parallel.param_layout import DEFAULT_OPT_THRESHOLD_KB, ParamLayout, layouts_from_rules


def lora_modules(model_config, pet_config) -> list[str]:
    """The modules of the model ``model_config`` describes that ``pet_config`` (the run config's
    LoRA section, :class:`~msllm.config_lora.PetConfig`) adapts ([] when it is None)."""
    return [] if pet_config is None else match_targets(model_config, pet_config.target_modules)


def lora_op_rules(model_config, pet_config, parallel_config,
                  stage_layers: Optional[Sequence[int]] = None) -> list[OpRule]:
    """The LoRA primitives' strategies, one group per module ``pet_config`` adapts (see the module
    docstring).

    Rows added for module P whose base rule is ``MatMul ((dp, w_in), (w_out, w_in))``::

        P.lora_dropout.dropout  ((dp, w_in),)                        (only with lora_dropout > 0)
        P.lora_a_matmul         ((dp, w_in), (None, w_in))   param P.lora_A.weight (r, in)
        P.mul_scale             ((dp, None), ())
        P.lora_b_matmul         ((dp, None), (w_out, None))  param P.lora_B.weight (out, r)
        P.add_lora              ((dp, w_out), (dp, w_out))

    Returns [] when ``pet_config`` is None.
    """
    modules = lora_modules(model_config, pet_config)
    if not modules:
        return []
    return _rules(model_config, parallel_config, modules, pet_config.lora_dropout > 0, stage_layers)


def _rules(model_config, parallel_config, modules: Sequence[str], dropout: bool,
           stage_layers: Optional[Sequence[int]]) -> list[OpRule]:
    """:func:`lora_op_rules` for adapted ``modules``, with a dropout row each when ``dropout``."""
    base = {r.path: r for r in op_rules(model_config, parallel_config, stage_layers) if r.prim == "matmul"}
    rules: list[OpRule] = []
    for module in modules:
        rule = base[module]
        (_, w_in), (w_out, _) = rule.in_strategy
        a_name, b_name = adapter_names(module)
        st = rule.stage
        if dropout:
            rules.append(OpRule(f"{module}.lora_dropout", "dropout", (("dp", w_in),), st))
        rules += [
            OpRule(module, "lora_a_matmul", (("dp", w_in), (None, w_in)), st, params=((1, a_name),)),
            OpRule(module, "mul_scale", (("dp", None), ()), st),
            OpRule(module, "lora_b_matmul", (("dp", None), (w_out, None)), st, params=((1, b_name),)),
            OpRule(module, "add_lora", (("dp", w_out), ("dp", w_out)), st),
        ]
    return rules


def lora_param_layouts(model_config, pet_config, parallel_config, stage_layers: Optional[Sequence[int]] = None,
                       include_optimizer_states: bool = True,
                       opt_threshold_kb: int = DEFAULT_OPT_THRESHOLD_KB) -> dict[str, ParamLayout]:
    """``{name: ParamLayout}`` of every adapter parameter (and ``adam_m.`` / ``adam_v.`` states) that
    ``pet_config`` (the run config's LoRA section) adds to the model ``model_config`` describes, to
    be merged with :func:`msllm.parallel.param_layout.param_layouts` (e.g. for
    ``write_strategy_files(..., layouts=...)``). {} when ``pet_config`` is None."""
    modules = lora_modules(model_config, pet_config)
    if not modules:
        return {}
    shapes = adapter_shapes(model_config, modules, pet_config.lora_rank)
    return layouts_from_rules(lora_op_rules(model_config, pet_config, parallel_config, stage_layers), shapes,
                              parallel_config, "float32", include_optimizer_states=include_optimizer_states,
                              opt_threshold_kb=opt_threshold_kb)


def lora_plan_inputs(run_config, stage_layers: Optional[Sequence[int]] = None):
    """``(layouts, trainable)`` for :func:`msllm.parallel.planner.plan` of a LoRA run: the model's
    and the adapters' parameter layouts, and the adapters' names (the base is frozen); ``(None,
    None)`` without ``pet_config`` (the planner's defaults: every parameter of the model trains)."""
    from msllm.parallel.param_layout import param_layouts

    pet = run_config.pet_config
    if pet is None:
        return None, None
    mc, pc = run_config.model_config, run_config.parallel_config
    adapters = lora_param_layouts(mc, pet, pc, stage_layers)
    trainable = {n for n in adapters if not n.startswith(("adam_m.", "adam_v.", "accu_grads."))}
    return {**param_layouts(mc, pc, stage_layers), **adapters}, trainable


def apply_lora_layout(network, parallel_config, stage_layers: Optional[Sequence[int]] = None) -> list[OpRule]:
    """``.shard()`` the LoRA primitives of ``network`` (after :func:`~msllm.lora.apply.apply_lora`
    and :func:`msllm.parallel.apply.apply_layout`) per :func:`lora_op_rules`, for the modules and
    dropout :func:`~msllm.lora.apply.apply_lora` recorded on the network (``network.lora_info``).
    Returns the rules. A rule whose primitive or parameter is missing raises AssertionError (table
    and cells drifted); a network without LoRA, MsllmError."""
    from msllm.lora.apply import resolve_cell

    info = getattr(network, "lora_info", None)
    if info is None:
        raise MsllmError("apply_lora_layout: the network has no LoRA adapters (call apply_lora first)")
    dp, mp = parallel_config.data_parallel, parallel_config.model_parallel
    rules = _rules(network.config, parallel_config, info.modules, info.dropout > 0, stage_layers)
    for rule in rules:
        cell = resolve_cell(network, rule.path)[2]
        prim = getattr(cell, rule.prim, None)
        if prim is None or not hasattr(prim, "shard"):
            raise AssertionError(f"LoRA layout rule {rule.name}: the network has no primitive there")
        prim.shard(concrete(rule.in_strategy, dp, mp), concrete(rule.out_strategy, dp, mp))
        for _, pname in rule.params:
            which = pname.rsplit(".", 2)[-2]  # lora_A / lora_B
            if getattr(cell, which).weight.name != pname:
                raise AssertionError(f"LoRA layout rule {rule.name}: expected parameter {pname}")
    return rules


__all__ = ["lora_modules", "lora_op_rules", "lora_param_layouts", "apply_lora_layout"]
