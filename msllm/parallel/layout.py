"""Parallel layouts of the LLaMA model: one table of sharding rules, applied to the network on
Ascend (:func:`apply_layout`) and evaluated offline without a network (:func:`param_layouts`).

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
* pipeline: embedding on stage 0, decoder layers split evenly over ``pipeline_stage`` stages
  (or per an explicit per-stage list), final norm, head and loss on the last stage.

One source of truth: :func:`op_rules` lists, for a model config and layout, every primitive to
shard with a *symbolic* strategy (axis names ``"dp"``, ``"mp"``, ``"dpmp"`` = both, ``None`` = 1)
and the parameters each op consumes. :func:`apply_layout` turns the symbols into numbers and
calls ``.shard()``; :func:`param_layouts` turns the same symbols of the parameter inputs into
MindSpore tensor layouts (device matrix + tensor map). Nothing here allocates weights.

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
(MindFormers sets ``parallel_optimizer=False`` on RMSNorm weights; :func:`apply_layout` does the
same), its full size is at least ``parallel_optimizer_threshold`` KB (64 by default), it is
replicated on more than one rank of its stage, and its sliced first axis divides by that count.
That split is recorded as the strategy-file fields ``opt_weight_shard_size`` (ranks in the
group) and ``opt_weight_shard_step`` (rank distance between group members), exactly the fields
MindSpore writes when ``optimizer_weight_shard_aggregated_save`` is off
(``OperatorInfo::CreateGroupForOptShard``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence

from msllm.errors import MsllmError
from msllm.kernels import select
from msllm.models.llama.names import OPTIMIZER_STATE_PREFIXES, is_norm_weight, is_optimizer_state, param_shapes

Sym = Optional[str]          # "dp", "mp", "dpmp" or None (= not split)
SymStrategy = tuple[tuple[Sym, ...], ...]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# MindSpore's default parallel_optimizer_threshold (KB), see parallel_context_kwargs.
DEFAULT_OPT_THRESHOLD_KB = 64


# ---------------------------------------------------------------------------------------------
# Validation


def stage_layer_counts(num_layers: int, pipeline_stage: int,
                       stage_layers: Optional[Sequence[int]] = None) -> list[int]:
    """Decoder layers per pipeline stage.

    ``stage_layers`` (explicit, one count per stage, each >= 1, summing to ``num_layers``) wins.
    Otherwise layers are split as evenly as possible; when ``num_layers % pipeline_stage != 0``
    the extra layers go to the middle stages first (stage 0 already holds the embedding and the
    most in-flight micro batches under 1F1B, the last stage the output head and loss).

    Raises:
        MsllmError: a bad explicit list or fewer layers than stages.
    """
    if stage_layers is not None:
        counts = [int(c) for c in stage_layers]
        if len(counts) != pipeline_stage:
            raise MsllmError(f"stage_layers={counts} has {len(counts)} entries, but "
                             f"parallel_config.pipeline_stage={pipeline_stage}: give one layer count per stage")
        if any(c < 1 for c in counts):
            raise MsllmError(f"stage_layers={counts}: every pipeline stage needs at least one layer")
        if sum(counts) != num_layers:
            raise MsllmError(f"stage_layers={counts} sums to {sum(counts)}, but "
                             f"model.model_config.num_layers={num_layers}")
        return counts
    if num_layers < pipeline_stage:
        raise MsllmError(f"parallel_config.pipeline_stage={pipeline_stage} exceeds "
                         f"model.model_config.num_layers={num_layers}: every stage needs a layer")
    base, extra = divmod(num_layers, pipeline_stage)
    counts = [base] * pipeline_stage
    order = list(range(1, pipeline_stage - 1)) + [pipeline_stage - 1, 0] if pipeline_stage > 2 \
        else list(range(pipeline_stage))[::-1]
    for s in order[:extra]:
        counts[s] += 1
    return counts


def layer_stages(num_layers: int, pipeline_stage: int,
                 stage_layers: Optional[Sequence[int]] = None) -> list[int]:
    """The pipeline stage of each decoder layer, in layer order (see :func:`stage_layer_counts`)."""
    out: list[int] = []
    for stage, count in enumerate(stage_layer_counts(num_layers, pipeline_stage, stage_layers)):
        out.extend([stage] * count)
    return out


def validate_layout(model_config, parallel_config, device_num: Optional[int] = None,
                    global_batch_size: Optional[int] = None,
                    stage_layers: Optional[Sequence[int]] = None) -> list[int]:
    """Check a :class:`ParallelLayoutConfig` against a :class:`LlamaConfig`; returns layers per stage.

    Rules (each failure is one :class:`MsllmError` naming the key):
        * data_parallel, model_parallel, pipeline_stage, micro_batch_num >= 1;
        * num_heads and n_kv_heads divisible by model_parallel (heads are the unit of the
          attention split; GQA key/value heads too, Ainslie et al. 2023);
        * intermediate (ffn) size divisible by model_parallel (column/row split of the MLP);
        * vocab_size divisible by model_parallel when ``vocab_emb_dp`` is False (vocab-parallel
          embedding and head);
        * seq_length divisible by model_parallel with ``use_seq_parallel``;
        * num_layers >= pipeline_stage, or a valid explicit ``stage_layers`` list;
        * pipeline_stage > 1: micro_batch_num >= pipeline_stage (1F1B needs the pipeline full)
          and untied embeddings (a table shared by the first and last stage is not supported);
        * ``global_batch_size`` (if given) divisible by data_parallel x micro_batch_num;
        * ``device_num`` (if given) == data_parallel x model_parallel x pipeline_stage.
    """
    pc, mc = parallel_config, model_config
    pc.validate("parallel_config")
    mp = pc.model_parallel
    if mc.num_heads % mp:
        raise MsllmError(f"model.model_config.num_heads={mc.num_heads} is not divisible by "
                         f"parallel_config.model_parallel={mp}: attention is split by heads")
    if mc.kv_heads % mp:
        raise MsllmError(f"model.model_config.n_kv_heads={mc.kv_heads} is not divisible by "
                         f"parallel_config.model_parallel={mp}: key/value heads are split like query heads")
    if mc.ffn_size % mp:
        raise MsllmError(f"model.model_config.intermediate_size (ffn size {mc.ffn_size}) is not divisible "
                         f"by parallel_config.model_parallel={mp}")
    if not pc.vocab_emb_dp and mc.vocab_size % mp:
        raise MsllmError(f"model.model_config.vocab_size={mc.vocab_size} is not divisible by "
                         f"parallel_config.model_parallel={mp}, which a vocab-parallel embedding needs "
                         "(parallel_config.vocab_emb_dp=False); set vocab_emb_dp: True or pad the vocabulary")
    if pc.use_seq_parallel and mc.seq_length % mp:
        raise MsllmError(f"parallel_config.use_seq_parallel needs model.model_config.seq_length="
                         f"{mc.seq_length} divisible by parallel_config.model_parallel={mp}")
    counts = stage_layer_counts(mc.num_layers, pc.pipeline_stage, stage_layers)
    if pc.pipeline_stage > 1:
        if pc.micro_batch_num < pc.pipeline_stage:
            raise MsllmError(f"parallel_config.micro_batch_num={pc.micro_batch_num} is smaller than "
                             f"parallel_config.pipeline_stage={pc.pipeline_stage}: 1F1B pipelining needs at "
                             "least one micro batch per stage")
        if mc.tie_word_embeddings:
            raise MsllmError("model.model_config.tie_word_embeddings=True with parallel_config.pipeline_stage"
                             f"={pc.pipeline_stage}: a table shared by the first and last stage is not supported")
    if global_batch_size is not None and global_batch_size % (pc.data_parallel * pc.micro_batch_num):
        raise MsllmError(f"global batch size {global_batch_size} is not divisible by parallel_config."
                         f"data_parallel x micro_batch_num = {pc.data_parallel} x {pc.micro_batch_num}")
    if device_num is not None and device_num != pc.device_num:
        raise MsllmError(f"parallel_config: data_parallel x model_parallel x pipeline_stage = "
                         f"{pc.data_parallel} x {mp} x {pc.pipeline_stage} = {pc.device_num}, "
                         f"but the device count is {device_num}")
    return counts


def global_batch_size(run_config) -> int:
    """Samples per optimizer step over all ranks, MindFormers' formula:
    ``batch_size x data_parallel x micro_batch_num x gradient_accumulation_steps``, where
    ``runner_config.batch_size`` is one micro batch of one data-parallel rank
    (``micro_batch_num`` counts only when pipelining, ``pipeline_stage > 1``)."""
    pc, rc = run_config.parallel_config, run_config.runner_config
    micro = pc.micro_batch_num if pc.pipeline_stage > 1 else 1
    return rc.batch_size * pc.data_parallel * micro * rc.gradient_accumulation_steps


def optimizer_shard_enabled(run_config) -> bool:
    """Whether the run shards the optimizer; ``parallel_config.optimizer_shard`` and
    ``parallel.enable_parallel_optimizer`` must agree (MsllmError otherwise)."""
    a, b = run_config.parallel_config.optimizer_shard, run_config.parallel.enable_parallel_optimizer
    if a != b:
        raise MsllmError(f"parallel_config.optimizer_shard={a} disagrees with parallel.enable_parallel_optimizer"
                         f"={b}; they name the same switch (MindSpore's parallel optimizer): set both")
    return a


def validate_run_layout(run_config, device_num: Optional[int] = None,
                        stage_layers: Optional[Sequence[int]] = None) -> list[int]:
    """:func:`validate_layout` for a whole :class:`RunConfig`, plus the rules joining sections:
    model_parallel/pipeline_stage > 1 need ``parallel.parallel_mode`` semi_auto_parallel, and the
    two optimizer-shard switches must agree. Returns the layers per stage."""
    pc = run_config.parallel_config
    mode = run_config.parallel.mode_name
    if (pc.model_parallel > 1 or pc.pipeline_stage > 1) and mode != "semi_auto_parallel":
        raise MsllmError(f"parallel_config.model_parallel={pc.model_parallel}, pipeline_stage="
                         f"{pc.pipeline_stage} need parallel.parallel_mode: 1 (semi_auto_parallel), "
                         f"got {run_config.parallel.parallel_mode!r}")
    if mode in ("auto_parallel", "hybrid_parallel"):
        raise MsllmError(f"parallel.parallel_mode={run_config.parallel.parallel_mode!r}: msllm sets strategies "
                         "by hand; use 0 (data_parallel) or 1 (semi_auto_parallel)")
    optimizer_shard_enabled(run_config)
    return validate_layout(run_config.model_config, pc, device_num, global_batch_size(run_config), stage_layers)


# ---------------------------------------------------------------------------------------------
# The rule table


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


def concrete(strategy: Optional[SymStrategy], dp: int, mp: int):
    """Symbolic strategy -> MindSpore strategy tuple: ``"dp"`` -> dp, ``"mp"`` -> mp,
    ``"dpmp"`` -> dp*mp, ``None`` -> 1; ``None`` stays ``None``."""
    if strategy is None:
        return None
    size = {"dp": dp, "mp": mp, "dpmp": dp * mp, None: 1}
    return tuple(tuple(size[s] for s in dims) for dims in strategy)


def _linear(path: str, weight_split: tuple[Sym, Sym], stage: int, seq_parallel_out: bool = False) -> OpRule:
    """MatMul(x (N, in), W (out, in), transpose_b): x is split on N by dp and on its contracted
    axis like W's ``in`` axis; the weight strategy is ``weight_split``."""
    out = (("dpmp", None),) if seq_parallel_out else None
    return OpRule(path, "matmul", (("dp", weight_split[1]), weight_split), stage, out,
                  params=((1, f"{path}.weight"),))


def _rms_norm(path: str, stage: int, seq_parallel: bool, fused: bool = False) -> list[OpRule]:
    act: tuple[Sym, ...] = ("dp", "mp" if seq_parallel else None, None)      # (B, T, C)
    stat: tuple[Sym, ...] = ("dp", "mp" if seq_parallel else None, None)     # (B, T, 1)
    if fused:  # MindSpore's RmsNorm(x, gamma), gamma replicated, as MindFormers' LlamaRMSNorm.shard
        return [OpRule(path, "ascend_norm", (act, (None,)), stage, params=((1, f"{path}.weight"),))]
    return [
        OpRule(path, "square", (act,), stage),
        OpRule(path, "mean", (act,), stage),
        OpRule(path, "rsqrt", (stat,), stage),
        OpRule(path, "mul", (act, stat), stage),
        OpRule(path, "mul_weight", (act, (None,)), stage, params=((1, f"{path}.weight"),)),
    ]


def op_rules(model_config, parallel_config, stage_layers: Optional[Sequence[int]] = None,
             kernels=None) -> list[OpRule]:
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

    Not covered (the model computes them with functional ops, which MindSpore gives its default
    strategy and redistributes around): the half-splits of ``Attention.rotate`` (tensor slicing),
    ``repeat_kv``'s ``broadcast_to``, RMSNorm's ``+ eps`` and the loss's masking/sum. And
    ``Attention.transpose`` is one primitive used for both (B, T, H, D) -> (B, H, T, D) and back,
    so it can carry only one strategy: the q/k/v one; the output transpose is redistributed.
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
    col: tuple[Sym, Sym] = ("mp", None)
    row: tuple[Sym, Sym] = (None, "mp")
    heads4: tuple[Sym, ...] = ("dp", "mp", None, None)                      # (B, H, T, D) / (B, H, T, T)
    seq3: tuple[Sym, ...] = ("dp", "mp" if sp else None, None)              # (B, T, C)
    for i, st in enumerate(stages):
        lp = f"model.layers.{i}"
        ap, mp_ = f"{lp}.self_attn", f"{lp}.mlp"
        rules += _rms_norm(f"{lp}.input_layernorm", st, sp, fused_norm)
        rules += [
            _linear(f"{ap}.q_proj", col, st), _linear(f"{ap}.k_proj", col, st), _linear(f"{ap}.v_proj", col, st),
            # (B, T, H, D) -> (B, H, T, D): the head axis carries the mp split
            OpRule(ap, "transpose", (("dp", None, "mp", None),), st),
            OpRule(ap, "mul_cos", (heads4, (None, None)), st),
            OpRule(ap, "mul_sin", (heads4, (None, None)), st),
            OpRule(ap, "neg", (heads4,), st),
            OpRule(ap, "concat", (heads4, heads4), st),
            OpRule(ap, "add_rope", (heads4, heads4), st),
        ]
        if flash:  # q, k, v (B, N, S, D) and the (2048, 2048) mask; the None inputs take no strategy
            rules.append(OpRule(ap, "fa_score", (heads4, heads4, heads4, (None, None)), st))
        else:
            rules += [
                OpRule(ap, "bmm_qk", (heads4, heads4), st),
                OpRule(ap, "mul_scale", (heads4, ()), st),
                OpRule(ap, "add_mask", (heads4, (None, None)), st),
                OpRule(ap, "softmax", (heads4,), st),
                OpRule(ap, "bmm_pv", (heads4, heads4), st),
            ]
        rules.append(_linear(f"{ap}.o_proj", row, st, seq_parallel_out=sp))
        rules += _rms_norm(f"{lp}.post_attention_layernorm", st, sp, fused_norm)
        ffn2: tuple[Sym, ...] = ("dp", "mp")                                 # (N, F)
        rules += [
            _linear(f"{mp_}.gate_proj", col, st), _linear(f"{mp_}.up_proj", col, st),
            OpRule(mp_, "sigmoid", (ffn2,), st),
            OpRule(mp_, "mul_silu", (ffn2, ffn2), st),
            OpRule(mp_, "mul", (ffn2, ffn2), st),
            _linear(f"{mp_}.down_proj", row, st, seq_parallel_out=sp),
            OpRule(lp, "add_attn", (seq3, seq3), st),
            OpRule(lp, "add_mlp", (seq3, seq3), st),
        ]
    rules += _rms_norm("model.norm", last, sp, fused_norm)
    if mc.tie_word_embeddings:
        rules.append(OpRule("", "head_matmul", (("dp", None), (vocab_split, None)), last))
    else:
        rules.append(_linear("lm_head", (vocab_split, None), last))
    # The loss is not vocab-parallel (msllm's CausalLMLoss uses one LogSoftmax): with a
    # vocab-parallel head MindSpore all-gathers the logits before it.
    rules += [
        OpRule("loss", "log_softmax", (("dp", None),), last),
        OpRule("loss", "gather", (("dp", None), ("dp", None)), last),
    ]
    return rules


def cell_stages(model_config, parallel_config, stage_layers: Optional[Sequence[int]] = None) -> dict[str, int]:
    """Pipeline stage of each cell: embedding 0, layers per :func:`layer_stages`, final norm,
    head and loss the last stage."""
    last = parallel_config.pipeline_stage - 1
    out = {"model.embed_tokens": 0}
    for i, st in enumerate(layer_stages(model_config.num_layers, parallel_config.pipeline_stage, stage_layers)):
        out[f"model.layers.{i}"] = st
    out.update({"model.norm": last, "loss": last})
    if not model_config.tie_word_embeddings:
        out["lm_head"] = last
    return out


# ---------------------------------------------------------------------------------------------
# Parameter layouts


class ParamLayout(NamedTuple):
    """Where one parameter lives. The first four fields are the layout proper.

    dev_matrix: per-stage device matrix ``(dp, mp)``.
    tensor_map: per tensor axis, the device-matrix axis counted from the right (0 = mp, 1 = dp)
        that splits it, -1 = not split.
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


def _tensor_map(sym: tuple[Sym, ...]) -> tuple[int, ...]:
    return tuple(_SYM_TO_AXIS[s] for s in sym)


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
    """Per-parameter layout implied by :func:`op_rules`, without building the network.

    Returns ``{name: ParamLayout(dev_matrix, tensor_map, full_shape, stage, opt_shard_size,
    opt_shard_step, dtype)}`` for every parameter of ``LlamaForCausalLM`` and, with
    ``include_optimizer_states``, ``adam_m.{name}`` / ``adam_v.{name}`` with the same layout
    (see the module docstring for the optimizer-shard rule). The layout is not validated here;
    call :func:`validate_layout` first.
    """
    shapes = param_shapes(model_config)
    out = layouts_from_rules(op_rules(model_config, parallel_config, stage_layers), shapes, parallel_config,
                             model_config.param_init_type, lambda name: not is_norm_weight(name),
                             include_optimizer_states=False, opt_threshold_kb=opt_threshold_kb)
    missing = set(shapes) - set(out)
    if missing:  # a parameter without a rule: the table and the model disagree
        raise AssertionError(f"no sharding rule consumes {sorted(missing)}")
    return with_optimizer_states(out) if include_optimizer_states else out


def layouts_from_rules(rules: Iterable[OpRule], shapes: dict, parallel_config, dtype: str,
                       opt_shardable=lambda name: True, include_optimizer_states: bool = True,
                       opt_threshold_kb: int = DEFAULT_OPT_THRESHOLD_KB) -> dict[str, ParamLayout]:
    """``{name: ParamLayout}`` of the parameters that ``rules`` consume (full shapes from
    ``shapes``): the tensor map of the consuming input's strategy, and the parallel-optimizer
    split of the module docstring for parameters ``opt_shardable(name)`` allows. The one
    implementation behind :func:`param_layouts` (and layouts of added parameters, e.g. LoRA
    adapters)."""
    pc = parallel_config
    dev = (pc.data_parallel, pc.model_parallel)
    out: dict[str, ParamLayout] = {}
    for rule in rules:
        for idx, name in rule.params:
            tmap = _tensor_map(rule.in_strategy[idx])
            shape = shapes[name]
            size = step = 0
            if pc.optimizer_shard and opt_shardable(name):
                group = _opt_group(dev, tmap)
                nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
                first = shape[0] // (1 if tmap[0] == -1 else dev[len(dev) - 1 - tmap[0]])
                if len(group) > 1 and nbytes >= opt_threshold_kb * 1024 and first % len(group) == 0:
                    size, step = len(group), (group[-1] - group[0]) // (len(group) - 1)
            out[name] = ParamLayout(dev, tmap, shape, rule.stage, size, step, dtype)
    return with_optimizer_states(out) if include_optimizer_states else out


def with_optimizer_states(layouts: dict[str, ParamLayout]) -> dict[str, ParamLayout]:
    """``layouts`` plus ``adam_m.{name}`` / ``adam_v.{name}`` with their weight's layout
    (MindSpore clones a weight's layout for its optimizer states)."""
    out = dict(layouts)
    for name, lay in layouts.items():
        for prefix in OPTIMIZER_STATE_PREFIXES:
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
        if lay.stage != stage:
            continue
        if is_optimizer_state(name):
            states += lay.slice_bytes
        else:
            weights += lay.slice_bytes
    return {"weights": weights, "optimizer_states": states, "total": weights + states}


# ---------------------------------------------------------------------------------------------
# Applying the layout to a network (Ascend semi-auto parallel)


def _resolve(network, path: str):
    cell = network
    for part in path.split(".") if path else []:
        cell = cell[int(part)] if part.isdigit() else getattr(cell, part)
    return cell


def apply_layout(network, parallel_config, recompute_config=None,
                 stage_layers: Optional[Sequence[int]] = None) -> list[OpRule]:
    """Shard ``network`` (a :class:`LlamaForCausalLM`) per :func:`op_rules`; set pipeline stages
    and recomputation. Returns the applied rules.

    * every rule's primitive gets ``prim.shard(in_strategy, out_strategy)`` (numbers from the
      symbols; MindSpore reads them in SEMI_AUTO_PARALLEL and ignores them stand-alone);
    * RMSNorm weights get ``parallel_optimizer = False`` (see module docstring);
    * with ``pipeline_stage > 1`` each cell of :func:`cell_stages` gets ``cell.pipeline_stage``;
    * ``recompute_config.recompute``: each decoder layer ``recompute(mp_comm_recompute=...,
      parallel_optimizer_comm_recompute=..., recompute_slice_activation=...)`` (Chen et al. 2016;
      Korthikanti et al. 2022 "full" recomputation); ``select_recompute`` (and not ``recompute``):
      the attention core (BatchMatMul, scale, mask, Softmax) and the SwiGLU element-wise ops
      are recomputed (Korthikanti et al. 2022 sec. 5 "selective" recomputation, extended to the
      MLP activations as MindFormers' ``select_recompute`` does).

    The network must be the model the rules were derived from (``network.config``); a missing
    primitive or parameter raises AssertionError (the model and the table have drifted).
    """
    mc = network.config
    dp, mp = parallel_config.data_parallel, parallel_config.model_parallel
    rules = op_rules(mc, parallel_config, stage_layers, network.kernels)
    for rule in rules:
        cell = _resolve(network, rule.path)
        prim = getattr(cell, rule.prim, None)
        if prim is None or not hasattr(prim, "shard"):
            raise AssertionError(f"layout rule {rule.name}: the network has no primitive there")
        prim.shard(concrete(rule.in_strategy, dp, mp), concrete(rule.out_strategy, dp, mp))
        for _, pname in rule.params:
            param = getattr(cell, pname.rsplit(".", 1)[1], None)
            if param is None or param.name != pname:
                raise AssertionError(f"layout rule {rule.name}: expected parameter {pname}")
    for p in network.get_parameters():
        if p.name in set(no_opt_shard_params(mc)):
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


# ---------------------------------------------------------------------------------------------
# MindSpore auto-parallel context for Ascend


def strategy_file_name(rank: int, fmt: str = "ckpt") -> str:
    """``ckpt_strategy_rank_{rank}.ckpt`` (MindSpore's protobuf) or ``.json``. MindSpore picks the
    parser by extension: only ``.json`` files are read as JSON."""
    return f"ckpt_strategy_rank_{rank}.{'json' if fmt == 'json' else 'ckpt'}"


def strategy_format(run_config) -> str:
    """``"json"`` if ``parallel.strategy_ckpt_save_file`` ends in ``.json``, else ``"ckpt"``
    (protobuf): MindSpore's rule, by extension. The files themselves are always
    ``{output_dir}/strategy/ckpt_strategy_rank_{i}.{ext}``, where MindFormers puts them."""
    return "json" if run_config.parallel.strategy_ckpt_save_file.endswith(".json") else "ckpt"


def parallel_context_kwargs(run_config, rank: int = 0) -> dict:
    """Keyword arguments for ``mindspore.set_auto_parallel_context`` on Ascend.

    data_parallel mode: ``parallel_mode``, ``device_num``, ``gradients_mean``.
    semi_auto_parallel mode, additionally: ``full_batch``, ``enable_parallel_optimizer`` and
    ``parallel_optimizer_config`` (threshold 64 KB, ``optimizer_weight_shard_size`` -1 = the
    whole data-parallel group; :func:`param_layouts` assumes exactly these),
    ``pipeline_stages`` (+ ``pipeline_config`` 1F1B when > 1), and ``strategy_ckpt_config``
    saving this rank's strategy to ``{output_dir}/strategy/ckpt_strategy_rank_{rank}.ckpt``
    (protobuf; ``.json`` when ``parallel.strategy_ckpt_save_file`` ends in .json, :func:`strategy_format`)
    with ``only_trainable_params=False`` (so the AdamW moments are in it and checkpoints with
    them can be resharded).

    The runtime must also wrap the network for pipelining (``mindspore.nn.PipelineCell(net,
    micro_batch_num)``) and call :func:`apply_layout`.

    Raises:
        MsllmError: the layout needs a mode the config does not set (:func:`validate_run_layout`).
    """
    validate_run_layout(run_config)
    pc = run_config.parallel_config
    mode = run_config.parallel.mode_name
    kwargs = {"parallel_mode": mode, "device_num": pc.device_num,
              "gradients_mean": run_config.parallel.gradients_mean}
    if mode == "data_parallel":
        return kwargs
    opt = optimizer_shard_enabled(run_config)
    kwargs.update({
        "full_batch": run_config.parallel.full_batch,
        "enable_parallel_optimizer": opt,
        "pipeline_stages": pc.pipeline_stage,
        "strategy_ckpt_config": {
            "save_file": os.path.join(os.path.abspath(run_config.output_dir), "strategy",
                                      strategy_file_name(rank, strategy_format(run_config))),
            "only_trainable_params": False},
    })
    if opt:
        kwargs["parallel_optimizer_config"] = {"parallel_optimizer_threshold": DEFAULT_OPT_THRESHOLD_KB,
                                               "optimizer_weight_shard_size": -1}
    if pc.pipeline_stage > 1:
        kwargs["pipeline_config"] = {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}
    return kwargs


__all__ = ["OpRule", "ParamLayout", "apply_layout", "cell_stages", "concrete", "global_batch_size",
           "layer_stages", "op_rules", "param_layouts", "layouts_from_rules", "with_optimizer_states", "param_shapes", "parallel_context_kwargs",
           "rank_param_bytes", "rank_slices", "slice_for_rank", "stage_layer_counts", "stage_of_rank",
           "validate_layout", "validate_run_layout", "strategy_file_name", "strategy_format", "optimizer_shard_enabled",
           "DTYPE_BYTES", "DEFAULT_OPT_THRESHOLD_KB", "SELECT_RECOMPUTE"]
