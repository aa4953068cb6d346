"""The sharding rule table of the LLaMA model: every primitive a parallel layout splits, with a
symbolic strategy, and the pipeline stage of every cell.

Pattern: Megatron-LM tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", sec. 3, fig. 3),
expressed as MindSpore operator strategies the way MindFormers does it for LLaMA
(``mindformers/models/llama/llama_transformer.py``, ``llama_layer.py``, ``llama.py``):

* batch axis split ``data_parallel`` (dp) ways on every operator;
* q/k/v and gate/up projections are column-parallel: weight ``(out, in)`` split on ``out`` by
  ``model_parallel`` (mp), MatMul strategy ``((dp, 1), (mp, 1))``;
* o and down projections are row-parallel: weight split on ``in``, ``((dp, mp), (1, mp))``; the
  partial outputs are summed (AllReduce, or ReduceScatter with ``use_seq_parallel``);
* attention (BatchMatMul, Softmax, rotary Mul/Add) is split on the head axis: ``(dp, mp, 1, 1)``;
* RMSNorm weights are replicated; norm inputs ``(dp, 1, 1)`` (``(dp, mp, 1)`` with sequence
  parallelism, Korthikanti et al. 2022 sec. 4.2.2);
* embedding and output head: vocab-parallel (table/weight split on V by mp) when
  ``vocab_emb_dp`` is False, else replicated with the lookup/head data-parallel;
* pipeline: embedding on stage 0, decoder layers per :func:`msllm.parallel.layout_checks.layer_stages`,
  final norm, head and loss on the last stage (:func:`cell_stages`);
* mixture of experts (GShard, Lepikhin et al. 2020; MindFormers' ``expert_parallel``): the
  experts' fused weights (E, 2I, C) / (E, C, I) split on E by ``expert_parallel`` (ep) and
  within each expert row parallel by mp (both on C: :func:`_moe` says why); the (E, M, C) token
  buffers split (ep, dp/ep), so MindSpore moves the tokens to their experts' ranks and back by
  all-to-all (``enable_alltoall``, :mod:`msllm.parallel.context`) between the router's
  data-parallel layout and the experts'. The router and Qwen2-MoE's shared-expert gate are
  replicated, the shared expert is an ordinary column / row parallel MLP.

One source of truth: :func:`op_rules` lists, for a model config and layout, every primitive to
shard with a *symbolic* strategy (axis names ``"dp"``, ``"mp"``, ``"dpmp"`` = both, ``"ep"``,
``"dp/ep"`` (the data-parallel ranks of one expert group), ``None`` = 1)
and the parameters each op consumes. :func:`msllm.parallel.apply.apply_layout` turns the symbols
into numbers (:func:`concrete`) and calls ``.shard()``;
:func:`msllm.parallel.param_layout.param_layouts` turns the same symbols of the parameter inputs
into MindSpore tensor layouts (device matrix + tensor map). Nothing here builds a network or
allocates weights; the model file (:mod:`msllm.models.llama.model`) knows nothing of this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from msllm.kernels import select
from msllm.parallel.layout_checks import layer_stages

Sym = Optional[str]          # "dp", "mp", "dpmp", "ep", "dp/ep" or None (= not split)
SymStrategy = tuple[tuple[Sym, ...], ...]


@dataclass(frozen=True)
class OpRule:
    """One primitive to shard.

    path: cell path inside ``LlamaForCausalLM`` (``model.layers.3.self_attn.q_proj``).
    prim: attribute name of the primitive on that cell (``matmul``).
    in_strategy / out_strategy: symbolic strategies, one tuple per input (output).
    stage: pipeline stage of the cell.
    params: ``(input index, full parameter name)`` for inputs that are parameters.
    """

    path: str
    prim: str
    in_strategy: SymStrategy
    stage: int
    out_strategy: Optional[SymStrategy] = None
    params: tuple[tuple[int, str], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.path}.{self.prim}" if self.path else self.prim


def concrete(strategy: Optional[SymStrategy], dp: int, mp: int, ep: int = 1):
    """Symbolic strategy -> MindSpore strategy tuple: ``"dp"`` -> dp, ``"mp"`` -> mp,
    ``"dpmp"`` -> dp*mp, ``"ep"`` -> ep, ``"dp/ep"`` -> dp/ep, ``None`` -> 1; ``None`` stays ``None``."""
    if strategy is None:
        return None
    size = {"dp": dp, "mp": mp, "dpmp": dp * mp, "ep": ep, "dp/ep": dp // ep, None: 1}
    return tuple(tuple(size[s] for s in dims) for dims in strategy)


def _linear(path: str, weight_split: tuple[Sym, Sym], stage: int, seq_parallel_out: bool = False,
            bias: bool = False) -> list[OpRule]:
    """MatMul(x (N, in), W (out, in), transpose_b): x is split on N by dp and on its contracted
    axis like W's ``in`` axis; the weight strategy is ``weight_split``. A bias (out,) is added to
    the product split as the product's output: on ``out`` by mp for a column-parallel layer (the
    bias split like its weight's output dimension, as Megatron's ``ColumnParallelLinear``), whole
    after the partial sums of a row-parallel one (``RowParallelLinear`` adds it once, replicated)."""
    out = (("dpmp", None),) if seq_parallel_out else None
    rules = [OpRule(path, "matmul", (("dp", weight_split[1]), weight_split), stage, out,
                    params=((1, f"{path}.weight"),))]
    if bias:
        act: tuple[Sym, ...] = ("dpmp", None) if seq_parallel_out else ("dp", weight_split[0])
        rules.append(OpRule(path, "add_bias", (act, (weight_split[0],)), stage, params=((1, f"{path}.bias"),)))
    return rules


def _rms_norm(path: str, stage: int, seq_parallel: bool, fused: bool = False, offset: bool = False,
              act: Optional[tuple[Sym, ...]] = None) -> list[OpRule]:
    """RMSNorm's primitives; ``act``: the input's split (default (B, T, C) split on B, and on T
    with sequence parallelism); the weight is replicated (and so is Gemma's ``offset + w``)."""
    if act is None:
        act = ("dp", "mp" if seq_parallel else None, None)                   # (B, T, C)
    stat = act                                                               # (B, T, 1)
    weight = ((1, f"{path}.weight"),)
    pre = [OpRule(path, "add_offset", ((None,), ()), stage, params=((0, f"{path}.weight"),))] if offset else []
    if fused:  # MindSpore's RmsNorm(x, gamma), gamma replicated, as MindFormers' LlamaRMSNorm.shard
        return pre + [OpRule(path, "ascend_norm", (act, (None,)), stage, params=() if offset else weight)]
    return pre + [
        OpRule(path, "square", (act,), stage),
        OpRule(path, "mean", (act,), stage),
        OpRule(path, "rsqrt", (stat,), stage),
        OpRule(path, "mul", (act, stat), stage),
        OpRule(path, "mul_weight", (act, (None,)), stage, params=() if offset else weight),
    ]


def _moe(path: str, mc, stage: int) -> list[OpRule]:
    """A mixture-of-experts MLP (:mod:`msllm.models.llama.moe`, the dense dispatch): the router
    replicated on data-parallel tokens; the experts split on E by ep, their (E, M, C) token buffers
    on E by ep and on M by the dp/ep ranks of the expert group (module docstring).

    GShard's dispatch and combine (Lepikhin et al. 2020, sec. 2.2): the tokens are copied to every
    expert where they lie, ``(1, dp, 1)``, so moving them to the experts' ``(ep, dp/ep, mp)`` is one
    all-to-all inside each expert group (each rank keeps E/ep experts' copies of dp/ep times its
    tokens; the mp split of C is a local slice), and the weighted sum over the experts happens back at ``(1, dp, 1)`` after the reverse
    all-to-all. Inside each expert the fused ``gate_up_proj`` (E, 2I, C) is row parallel (C split
    by mp, one all-reduce of its (E, M, 2I) product over mp): split on 2I instead, as a column-
    parallel layer would be, its gate rows (the first I) and up rows would lie on different
    model-parallel ranks. ``down_proj`` (E, C, I) is row parallel as the dense MLP's."""
    ex = f"{path}.experts"
    tokens: tuple[Sym, ...] = (None, "dp", None)                              # (E or 1, N, C) where the tokens are
    buf: tuple[Sym, ...] = ("ep", "dp/ep", "mp")                              # (E, M, C)
    act: tuple[Sym, ...] = ("ep", "dp/ep", "mp")                              # (E, M, I)
    rules = _linear(f"{path}.gate", (None, None), stage) + [
        OpRule(ex, "expand_x", (("dp", None),), stage),                      # (N, C) -> (1, N, C)
        OpRule(ex, "broadcast_x", (tokens,), stage),                          # -> (E, N, C): a local copy
        OpRule(ex, "cast_x", (tokens,), stage),
        # (E, M, C) x (E, 2I, C)^T: the all-to-all into buf, then row parallel inside each expert
        OpRule(ex, "bmm_gate_up", (buf, ("ep", None, "mp")), stage, params=((1, f"{ex}.gate_up_proj"),)),
        OpRule(ex, "split_gate_up", (("ep", "dp/ep", None),), stage),         # (E, M, 2I) -> 2 x (E, M, I)
        OpRule(ex, "sigmoid", (act,), stage),
        OpRule(ex, "mul_silu", (act, act), stage),
        OpRule(ex, "mul", (act, act), stage),
        # (E, M, I) x (E, C, I)^T: row parallel, partial sums over mp
        OpRule(ex, "bmm_down", (act, ("ep", None, "mp")), stage, params=((1, f"{ex}.down_proj"),)),
        # the combine: weights (N, E) -> (E, N, 1) where the tokens are, the reverse all-to-all of
        # the experts' outputs, the weighted sum over E on each rank's own tokens
        OpRule(ex, "cast_w", (("dp", None),), stage),
        OpRule(ex, "transpose_w", (("dp", None),), stage),
        OpRule(ex, "expand_w", ((None, "dp"),), stage),
        OpRule(ex, "mul_weights", (tokens, tokens), stage),
        OpRule(ex, "sum_experts", (tokens,), stage),
    ]
    if mc.moe_config.shared_expert_intermediate_size:
        shared = f"{path}.shared_expert"
        rules += (_linear(f"{shared}.gate_proj", ("mp", None), stage) + _linear(f"{shared}.up_proj", ("mp", None), stage)
                  + _linear(f"{shared}.down_proj", (None, "mp"), stage) + _linear(f"{path}.shared_expert_gate",
                                                                                   (None, None), stage))
    return rules


def op_rules(model_config, parallel_config, stage_layers: Optional[Sequence[int]] = None,
             kernels=None, packed: bool = False) -> list[OpRule]:
    """Every primitive strategy of the layout, in network order (the single source of truth).

    ``kernels``: the model's :class:`msllm.kernels.select.KernelChoice` (default: what the layout
    path runs on Ascend for ``model_config``). With MindSpore's ``FlashAttentionScore`` the
    attention core is that one primitive, q/k/v (B, N, S, D) split (dp, mp, 1, 1) and the
    compressed causal mask replicated, as MindFormers 1.9.0 shards it for sparse_mode 2
    (``mindformers/modules/flash_attention.py``, ``_generate_flash_attention_strategy``); with
    ``RmsNorm`` each norm is one primitive (x split like the composed norm's input, gamma replicated).

    Shapes of the inputs (B batch, T sequence, C hidden, H heads, D head dim, F ffn, V vocab,
    N = B*T): Linear MatMul (N, in) x (out, in); rotary Mul/Add/Neg/Concat and BatchMatMul
    (B, H, T, D); scores, mask add and Softmax (B, H, T, T) with the mask (T, T); RMSNorm ops
    (B, T, C) with statistics (B, T, 1); MLP element-wise ops (N, F); embedding Gather
    (V, C) x (N,); loss LogSoftmax (N, V) and GatherD (N, V) x (N, 1).

    ``packed``: the rows hold several documents (``actual_seq_len``, :mod:`msllm.data.packing`):
    each row has its own positions and block-diagonal mask, so the rotary cos/sin are (B, 1, T, D)
    and the mask (B, 1, T, T), split on B by dp like the activations they meet (one sequence per
    row: (T, D) and (T, T), replicated). Compiled by the dry-run with no collective added
    (docs/packing.md). With MindSpore's ``FlashAttentionScore`` packed rows are refused
    (:func:`msllm.parallel.layout_checks.check_packed_layout`).

    Not covered (the model computes them with functional ops, which MindSpore gives its default
    strategy and redistributes around): RMSNorm's ``+ eps`` and the loss's masking/sum. And
    the attention's Split (rotate_half), output Transpose and repeat_kv's Tile are primitives with
    rules since the dry-run showed MindSpore's redistributions around them (AllGathers over the
    model-parallel group in every layer, docs/dryrun.md).
    """
    mc, pc = model_config, parallel_config
    if kernels is None:
        kernels = select.choose(mc, fast_paths=False, device="Ascend")
    flash = kernels.attention == select.ASCEND_FLASH
    fused_norm = kernels.norm == select.ASCEND_NORM
    sp = pc.use_seq_parallel and pc.model_parallel > 1
    stages = layer_stages(mc.num_layers, pc.pipeline_stage, stage_layers)
    last = pc.pipeline_stage - 1
    vocab_split: Sym = None if pc.vocab_emb_dp else "mp"
    rules: list[OpRule] = [
        OpRule("model.embed_tokens", "gather", ((vocab_split, None), ("dp",)), 0,
               params=((0, "model.embed_tokens.embedding_table"),)),
    ]
    if mc.embedding_multiplier != 1.0:  # Gemma's embedding scale, a scalar
        rules.append(OpRule("model", "mul_embed", (("dp", None, None), ()), 0))
    off = mc.rms_norm_offset != 0.0
    qkv_bias, o_bias = mc.qkv_bias, mc.o_bias
    col: tuple[Sym, Sym] = ("mp", None)
    row: tuple[Sym, Sym] = (None, "mp")
    heads4: tuple[Sym, ...] = ("dp", "mp", None, None)                      # (B, H, T, D) / (B, H, T, T)
    # rotary cos/sin and the additive mask: (T, D) / (T, T) shared by every row, or packed rows'
    # own (B, 1, T, D) / (B, 1, T, T)
    per_row: tuple[Sym, ...] = ("dp", None, None, None) if packed else (None, None)
    seq3: tuple[Sym, ...] = ("dp", "mp" if sp else None, None)              # (B, T, C)
    for i, st in enumerate(stages):
        lp = f"model.layers.{i}"
        ap, mp_ = f"{lp}.self_attn", f"{lp}.mlp"
        rules += _rms_norm(f"{lp}.input_layernorm", st, sp, fused_norm, off)
        for name in ("q_proj", "k_proj", "v_proj"):
            rules += _linear(f"{ap}.{name}", col, st, bias=qkv_bias)
        if mc.qk_norm:  # Qwen3: over D of (B, T, heads, D), heads split by mp; (D,) weights replicated
            for name in ("q_norm", "k_norm"):
                rules += _rms_norm(f"{ap}.{name}", st, sp, fused_norm, off, act=("dp", None, "mp", None))
        rules += [
            # (B, T, H, D) -> (B, H, T, D): the head axis carries the mp split
            OpRule(ap, "transpose", (("dp", None, "mp", None),), st),
            OpRule(ap, "split_half", (heads4,), st),                       # rotate_half's D/2 halves
            OpRule(ap, "mul_cos", (heads4, per_row), st),
            OpRule(ap, "mul_sin", (heads4, per_row), st),
            OpRule(ap, "neg", (heads4,), st),
            OpRule(ap, "concat", (heads4, heads4), st),
            OpRule(ap, "add_rope", (heads4, heads4), st),
        ]
        # attention output (B, H, T, D) -> (B, T, H, D), heads split as o_proj's row-parallel input wants
        rules.append(OpRule(ap, "transpose_out", (heads4,), st))
        if mc.kv_heads < mc.num_heads:  # repeat_kv: Tile of (B, K, 1, S, D), kv heads split by mp
            rules.append(OpRule(ap, "tile_kv", (("dp", "mp", None, None, None),), st))
        if flash:  # q, k, v (B, N, S, D) and the (2048, 2048) mask; the None inputs take no strategy
            rules.append(OpRule(ap, "fa_score", (heads4, heads4, heads4, (None, None)), st))
        else:
            rules += [
                OpRule(ap, "bmm_qk", (heads4, heads4), st),
                OpRule(ap, "mul_scale", (heads4, ()), st),
                OpRule(ap, "add_mask", (heads4, per_row), st),
                OpRule(ap, "softmax", (heads4,), st),
                OpRule(ap, "bmm_pv", (heads4, heads4), st),
            ]
        rules += _linear(f"{ap}.o_proj", row, st, seq_parallel_out=sp, bias=o_bias)
        rules += _rms_norm(f"{lp}.post_attention_layernorm", st, sp, fused_norm, off)
        ffn2: tuple[Sym, ...] = ("dp", "mp")                                 # (N, F)
        if mc.is_moe_layer(i):
            rules += _moe(mp_, mc, st)
            rules += [OpRule(lp, "add_attn", (seq3, seq3), st), OpRule(lp, "add_mlp", (seq3, seq3), st)]
            continue
        rules += _linear(f"{mp_}.gate_proj", col, st) + _linear(f"{mp_}.up_proj", col, st)
        if mc.hidden_act == "gelu_pytorch_tanh":
            rules.append(OpRule(mp_, "gelu", (ffn2,), st))
        else:
            rules += [OpRule(mp_, "sigmoid", (ffn2,), st), OpRule(mp_, "mul_silu", (ffn2, ffn2), st)]
        rules += [
            OpRule(mp_, "mul", (ffn2, ffn2), st),
            *_linear(f"{mp_}.down_proj", row, st, seq_parallel_out=sp),
            OpRule(lp, "add_attn", (seq3, seq3), st),
            OpRule(lp, "add_mlp", (seq3, seq3), st),
        ]
    rules += _rms_norm("model.norm", last, sp, fused_norm, off)
    if mc.tie_word_embeddings:
        rules.append(OpRule("", "head_matmul", (("dp", None), (vocab_split, None)), last))
    else:
        rules += _linear("lm_head", (vocab_split, None), last)
    # The loss is not vocab-parallel (msllm's CausalLMLoss uses one LogSoftmax): with a
    # vocab-parallel head MindSpore all-gathers the logits before it.
    rules += [
        OpRule("loss", "log_softmax", (("dp", None),), last),
        OpRule("loss", "gather", (("dp", None), ("dp", None)), last),
    ]
    return rules


def cell_stages(model_config, parallel_config, stage_layers: Optional[Sequence[int]] = None) -> dict[str, int]:
    """Pipeline stage of each cell: embedding 0, layers per
    :func:`~msllm.parallel.layout_checks.layer_stages`, final norm, head and loss the last stage."""
    last = parallel_config.pipeline_stage - 1
    out = {"model.embed_tokens": 0}
    for i, st in enumerate(layer_stages(model_config.num_layers, parallel_config.pipeline_stage, stage_layers)):
        out[f"model.layers.{i}"] = st
    out.update({"model.norm": last, "loss": last})
    if not model_config.tie_word_embeddings:
        out["lm_head"] = last
    return out


__all__ = ["OpRule", "Sym", "SymStrategy", "cell_stages", "concrete", "op_rules"]
