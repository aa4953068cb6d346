"""The LLaMA decoder in MindSpore, readable top to bottom. No parallel code lives here.

Architecture: Touvron et al. 2023 ("LLaMA", "Llama 2"), as in Meta's ``llama/model.py`` and HF
``transformers/models/llama/modeling_llama.py``: token embedding -> L x [RMSNorm -> causal
grouped-query self-attention with rotary position embedding -> residual -> RMSNorm -> SwiGLU MLP
-> residual] -> RMSNorm -> untied output head.

The family's other members are switches of :class:`LlamaConfig` (one table:
:mod:`msllm.models.llama.families`), each used in one place below (rotary scaling:
:mod:`msllm.models.llama.rotary`): q/k/v (and o) biases
(Qwen2, ``attention_bias``) in :class:`Linear`; an explicit ``head_dim``; ``qk_norm`` (Qwen3) in
:meth:`Attention.heads`; ``sliding_window`` (Mistral) in the causal masks and the flash kernels;
``rms_norm_offset`` (Gemma) in :class:`RMSNorm`; ``hidden_act`` (GeGLU) in :class:`MLP`;
``embedding_multiplier`` (Gemma) in :meth:`LlamaModel.embed`; ``moe_config`` (Mixtral, Qwen-MoE)
in :class:`DecoderLayer`, whose MLP is then :mod:`msllm.models.llama.moe`'s ``SparseMoE``.

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight`` ...) so the HF
conversion is a rename-free copy; weight matrices are stored ``(out_features, in_features)`` like
``torch.nn.Linear``. Rotary embedding uses the HF "rotate_half" layout (see ``msllm/convert``).

Every operator that a parallel layout may split is a primitive held as an attribute
(``self.matmul``, ``self.bmm_qk`` ...): ``msllm.parallel`` calls ``.shard(...)`` on them and sets
pipeline stages and recompute on the cells, without this file knowing about it.

Two ways through the network: ``construct`` (training and scoring: the whole sequence, causal
mask) and ``forward_cached`` (generation: new tokens only, keys/values of earlier tokens read
from a :class:`~msllm.models.llama.kv_cache.KVCache`, per-row positions and key positions so
left-padded batches decode row by row exactly). Both build their rotary angles and masks for the
positions in use (:mod:`~msllm.models.llama.batch_layout`): memory follows the sequence, never
``max_position_embeddings``. The training graph never builds the cached path.

``fast_paths`` (a builder argument; :attr:`msllm.config.RunConfig.fast_paths` is True on CPU
without operator sharding) selects shapes MindSpore's CPU kernels run faster: 2-D RMSNorm and
softmax views and the loss over target positions only. Each is commented where it is used, with
the gain measured in BENCHMARKS.md. Without it the model keeps the shapes that
``msllm.parallel.layout_rules``' primitive strategies are written for (the path Ascend runs).

Fused operators (:func:`msllm.kernels.select.choose`, from the config keys ``cpu_kernels``,
``use_flash_attention``, ``fused_rms_norm``): on the CPU fast path msllm's own C++ kernels
(``msllm/kernels``: oneDNN GEMMs, flash attention, RMSNorm + residual add, SwiGLU, rotary); on the
layout path MindSpore's Ascend primitives ``FlashAttentionScore`` and ``RmsNorm``. Each fused
path says where it comes from in one comment; the composed operators remain the fallback.

Shape letters: B batch, T sequence, C hidden, H query heads, K key/value heads, D head dim,
F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Constant, Normal, initializer
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from msllm.kernels.select import ASCEND_FLASH, ASCEND_NORM, CPU_FLASH, CPU_NORM, KernelChoice, choose
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.kv_cache import KVCache
from msllm.models.llama.moe import SparseMoE, load_balancing_loss
from msllm.models.llama.batch_layout import (additive_mask, causal_positions, document_layout, document_mask,
                                             document_targets)
from msllm.models.llama.rotary import rotary_frequencies

log = logging.getLogger("msllm")

_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def ms_dtype(name: str):
    """MindSpore dtype for a config dtype name (``float32`` / ``float16`` / ``bfloat16``)."""
    return _DTYPES[name]


class Linear(nn.Cell):
    """``y = x @ W^T (+ b)``; W: (out_features, in_features) like ``torch.nn.Linear``, b: (out,)
    with ``bias`` (zeros at initialisation, as HF's ``_init_weights``).

    Input (N, in) in any float dtype, computed in ``compute_dtype``, output (N, out).
    ``kernels`` (:class:`msllm.kernels.ops.CpuKernels`): the product runs on msllm's oneDNN sgemm
    kernel (same arguments, x W^T) instead of MindSpore's CPU MatMul; ``dynamic_rows`` when N is
    known only at run time (the output head under the compact loss). The bias is one broadcast
    add after the product on every path (``self.add_bias``, split like the output by a layout).
    """

    def __init__(self, in_features: int, out_features: int, config: LlamaConfig, std: float, kernels=None,
                 dynamic_rows: bool = False, bias: bool = False):
        super().__init__()
        self.weight = Parameter(initializer(Normal(std), (out_features, in_features),
                                            ms_dtype(config.param_init_type)), name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,), ms_dtype(config.param_init_type)),
                              name="bias") if bias else None
        self.compute_dtype = ms_dtype(config.compute_dtype)
        if kernels is None:
            self.matmul = self.matmul_static = ops.MatMul(transpose_b=True)
        else:  # fused path: msllm/kernels/csrc/linear.cc (oneDNN sgemm from the mindspore wheel)
            self.matmul = kernels.linear_dynamic_rows if dynamic_rows else kernels.linear
            self.matmul_static = kernels.linear
        # the kernel reads float32 or bfloat16 weights itself (float32 arithmetic; msllm.kernels.select
        # builds the kernels for no other dtype): no float32 copy of a bf16 weight per call
        self.weight_as_stored = kernels is not None
        self.add_bias = ops.Add()
        self.cast = ops.Cast()
        self.int8 = False   # weight-only int8 (inference): see use_int8
        # whether msllm's fused decode step may read this layer's weight directly (no bias; a
        # LoRALinear around the layer says False): DecoderLayer.decode_fused
        self.fusable = kernels is not None and not bias
        self.layer_index = None   # (1,) int32 once the weight is a slice of a stacked one: see use_stacked

    def use_int8(self, q: np.ndarray, scale: np.ndarray, group: int, kernels) -> None:
        """Hold the weight as int8 q (out, in) with float32 scales (out, G), each covering ``group``
        inputs, and multiply on msllm's ``linear_int8`` kernel: y = x (q * scale)^T (+ b), float32
        (inference only: no gradient). Made by :func:`msllm.models.llama.int8_model.quantize_model`;
        the parameters keep this layer's names (``...q_proj.weight``, ``...q_proj.weight_scale``)."""
        name = self.weight.name
        self.weight = Parameter(Tensor(q), name=name, requires_grad=False)
        self.weight_scale = Parameter(Tensor(scale), name=name + "_scale", requires_grad=False)
        self.group = kernels.group_tensor(group)
        self.matmul_int8 = kernels.linear_int8
        self.int8 = True

    def use_stacked(self, weight: Parameter, scale: Parameter | None, layer: int, kernels) -> None:
        """Read the weight as slice ``layer`` of ``weight`` (L, out, in), shared by every decoder layer's
        same projection (and with int8 ``scale`` (L, out, G)), on msllm's ``linear_layer`` /
        ``linear_int8_layer`` kernels, which read the slice where it lies: the same products and bits
        (inference only: no gradient). Made by :func:`msllm.models.llama.stacked.stack_decoder_weights`."""
        self.weight = weight
        if self.int8:
            self.weight_scale = scale
            self.matmul_int8 = kernels.linear_int8_layer
        else:
            self.matmul_static = self.matmul = kernels.linear_layer
        self.layer_index = Tensor(np.array([layer], np.int32))

    def decode_weights(self):
        """This layer's weight as msllm's fused decode step takes it (csrc/decode_fused.cc): a
        1-tuple (weight (out, in) float32 / bfloat16), or with int8 the 3-tuple (q (out, in) int8,
        scale (out, G) float32, group (1,) float32)."""
        if self.int8:
            return self.weight, self.weight_scale, self.group
        return (self.weight,)

    def construct(self, x, static_rows=False):
        """x (..., in) -> (..., out); ``static_rows`` (a compile-time constant): the row count is
        known when the graph compiles, so a ``dynamic_rows`` layer runs the plain kernel
        (generation and scoring through the output head)."""
        if self.int8:   # weight-only int8 (msllm/kernels/csrc/linear_int8.cc), float32 arithmetic
            if self.layer_index is None:
                y = self.matmul_int8(self.cast(x, ms.float32), self.weight, self.weight_scale, self.group)
            else:       # a slice of the stacked weights (use_stacked)
                y = self.matmul_int8(self.cast(x, ms.float32), self.weight, self.weight_scale, self.group,
                                     self.layer_index)
            if self.bias is None:
                return y
            return self.add_bias(y, self.cast(self.bias, ms.float32))
        if self.layer_index is not None:   # a slice of the stacked weights (use_stacked): float32 x
            y = self.matmul(self.cast(x, ms.float32), self.weight, self.layer_index)
            return y if self.bias is None else self.add_bias(y, self.cast(self.bias, ms.float32))
        w = self.weight if self.weight_as_stored else self.cast(self.weight, self.compute_dtype)
        y = (self.matmul_static if static_rows else self.matmul)(self.cast(x, self.compute_dtype), w)
        if self.bias is None:
            return y
        return self.add_bias(y, self.cast(self.bias, self.compute_dtype))


class RMSNorm(nn.Cell):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * w``,
    or ``* (offset + w)`` with ``config.rms_norm_offset`` (Gemma's ``1 + w``, computed in the
    statistics' dtype before the cast back, as ``GemmaRMSNorm``).

    Input (..., C); the statistics are computed in ``layernorm_compute_type`` (fp32 by default)
    and the result is cast back to the input dtype.

    With ``flat`` (the CPU fast path) the input is viewed as 2-D (N, C) while normalising:
    MindSpore's CPU reductions (the mean here, the weight and statistics gradients) are 4-7x
    slower on (B, T, C) than on (B*T, C); forward + both gradients of one norm took 10.7 ms on
    (8, 256, 256) and 3.2 ms on its 2-D view (24 ms vs 7 ms on (4, 512, 512);
    benchmarks/micro_ops.py --which norm).

    ``impl`` (:class:`msllm.kernels.select.KernelChoice` names): ``CPU_NORM`` runs msllm's one-pass
    kernel (``kernels``), ``ASCEND_NORM`` MindSpore's ``RmsNorm`` primitive, anything else the
    composed operators. :meth:`add_and_norm` also fuses the residual add before the norm.
    """

    def __init__(self, hidden_size: int, eps: float, config: LlamaConfig, flat: bool = False,
                 impl: str = "", kernels=None):
        super().__init__()
        # Gemma stores w with 1 + w the scale, so its neutral value is 0
        self.offset = float(config.rms_norm_offset)
        self.weight = Parameter(initializer(Constant(1.0 - self.offset), (hidden_size,),
                                            ms_dtype(config.param_init_type)), name="weight")
        self.add_offset = ops.Add()
        self.eps = eps
        self.norm_dtype = ms_dtype(config.layernorm_compute_type)
        self.cast = ops.Cast()
        self.square = ops.Square()
        self.mean = ops.ReduceMean(keep_dims=True)
        self.rsqrt = ops.Rsqrt()
        self.mul = ops.Mul()
        self.mul_weight = ops.Mul()
        self.reshape = ops.Reshape()
        self.flat = flat
        self.fused = None
        self.fused_add = None
        self.ascend_norm = None
        if impl == CPU_NORM:  # fused path: msllm/kernels/csrc/norm.cc (one pass, rstd kept for backward)
            self.fused, self.fused_add = kernels.rms_norm, kernels.add_rms_norm
            self.eps_tensor = kernels.eps_tensor(eps)
        elif impl == ASCEND_NORM:  # fused path: MindSpore's ops.RmsNorm (Ascend; x / rms(x) * gamma, rstd)
            self.ascend_norm = ops.RmsNorm(eps)

    def scale(self, dtype):
        """The multiplier (C,) in ``dtype``: w, or offset + w computed in float32 first."""
        if self.offset == 0.0:
            return self.cast(self.weight, dtype)
        return self.cast(self.add_offset(self.cast(self.weight, ms.float32), self.offset), dtype)

    def add_and_norm(self, x, a):
        """With msllm's kernel only: x, a (B, T, C) -> (h = x + a, norm(h)), both (B, T, C)."""
        h, y, _ = self.fused_add(x, a, self.scale(ms.float32), self.eps_tensor)
        return h, y

    def construct(self, x):
        if self.fused is not None:
            return self.fused(x, self.scale(ms.float32), self.eps_tensor)[0]
        if self.ascend_norm is not None:
            return self.ascend_norm(x, self.scale(x.dtype))[0]
        dtype, shape = x.dtype, x.shape
        if self.flat:
            x = self.reshape(x, (-1, shape[-1]))                                # (N, C)
        x = self.cast(x, self.norm_dtype)
        x = self.mul(x, self.rsqrt(self.mean(self.square(x), -1) + self.eps))
        if self.offset == 0.0:  # LLaMA: cast, then scale in the input dtype (HF LlamaRMSNorm)
            out = self.mul_weight(self.cast(x, dtype), self.cast(self.weight, dtype))
        else:                   # Gemma: scale by (offset + w) in float32, then cast
            out = self.cast(self.mul_weight(x, self.scale(self.norm_dtype)), dtype)
        return self.reshape(out, shape) if self.flat else out


class Attention(nn.Cell):
    """Causal grouped-query self-attention with rotary embeddings (Ainslie et al. 2023 for GQA).

    Input x (B, T, C); output (B, T, C). K = n_kv_heads key/value heads of width D (``head_dim``,
    H * D need not equal C) are shared by H / K query heads each. ``construct`` attends causally
    within x (within the last ``sliding_window`` keys when set); ``construct_cached`` appends x's
    keys/values to a cache of S slots and attends over the cache under a given mask. Biases on
    q/k/v (and o) per ``qkv_has_bias`` / ``attention_bias``; ``qk_norm``: RMSNorm over each head
    of q and k before rotary (Qwen3's ``q_norm`` / ``k_norm``, weights (D,)).

    ``choice.attention`` (:func:`msllm.kernels.select.choose`) picks how ``construct`` attends:
    msllm's CPU flash kernel, MindSpore's Ascend ``FlashAttentionScore``, or the composed
    operators (scores (B, H, T, T) -> mask -> softmax -> x V). The cached path is composed, except
    one new token per row on msllm's CPU kernels (:meth:`decode_one`).
    """

    def __init__(self, config: LlamaConfig, fast_paths: bool = False, choice: KernelChoice | None = None,
                 layer: int = 0):
        super().__init__()
        c, h, k, d = config.hidden_size, config.num_heads, config.kv_heads, config.head_dim
        std = config.initializer_range
        kern = choice.cpu if choice is not None else None
        self.n_heads, self.n_kv, self.head_dim, self.n_rep, self.hidden = h, k, d, h // k, c
        self.q_proj = Linear(c, h * d, config, std, kern, bias=config.qkv_bias)
        self.k_proj = Linear(c, k * d, config, std, kern, bias=config.qkv_bias)
        self.v_proj = Linear(c, k * d, config, std, kern, bias=config.qkv_bias)
        self.o_proj = Linear(h * d, c, config, std, kern, bias=config.o_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # over the last axis D of (B, T, heads, D)
            norm = choice.norm if choice is not None else ""
            self.q_norm = RMSNorm(d, config.rms_norm_eps, config, fast_paths, norm, kern)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, config, fast_paths, norm, kern)
        window = config.layer_window(layer)
        attention = choice.attention if choice is not None else ""
        self.flash = self.flash_padded = None
        self.fa_score = None
        # decoding (one new token over the cache): msllm/kernels/csrc/decode.cc, one pass over the
        # cache per key/value head instead of repeat_kv + two matmuls + softmax
        self.decode_attention = kern.decode_attention if kern is not None else None
        self.rope = kern.rope if kern is not None else None
        if attention == CPU_FLASH:
            # fused path: msllm/kernels/csrc/attention.cc (FlashAttention-2 blocking on the CPU; q, k,
            # v stay in the projections' (B, T, heads, D) layout; rotary by csrc/elementwise.cc)
            self.flash, self.flash_padded = kern.flash_attention, kern.flash_attention_padded
            # packed rows: each query sees only its own document's keys (blocks before the
            # document's start are skipped; csrc/attention.cc)
            self.flash_docs = kern.flash_attention_docs
            self.window = kern.window_tensor(window)
        elif attention == ASCEND_FLASH:
            # fused path: MindSpore's FlashAttentionScore (Ascend; its docstring in mindspore 2.10
            # ops/auto_generate/gen_ops_prim.py): layout "BNSD" = (B, N, S, D), N2 = K kv heads
            # dividing N1 = H (GQA without repeat_kv), scale 1/sqrt(D), sparse_mode 2 =
            # "leftUpCausal" with the compressed (2048, 2048) uint8 mask, 1 = discard (above the
            # diagonal); output 3 is attention_out (B, H, T, D). A sliding window W is its
            # sparse_mode 4 ("band": keys from pre_tokens before the query to next_tokens after,
            # same compressed mask): pre_tokens W - 1, next_tokens 0 = keys q - W < k <= q
            band = window is not None
            self.fa_score = FlashAttentionScore(head_num=h, keep_prob=1.0, scale_value=1.0 / math.sqrt(d),
                                                pre_tokens=window - 1 if band else 2147483647,
                                                next_tokens=0 if band else 2147483647,
                                                inner_precise=0, input_layout="BNSD", sparse_mode=4 if band else 2)
            self.fa_mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1), ms.uint8)
            # packed rows: the same primitive in layout "TND" (the batch's B*T tokens one after another)
            # with actual_seq_qlen = actual_seq_kvlen = the cumulative document ends over the whole
            # batch and sparse_mode 3 ("rightDownCausal", the compressed mask): causal attention
            # inside each document, as MindFormers' LLaMA does with use_eod_attn_mask_compression
            # (mindformers/parallel_core/training_graph/transformer/flash_attention.py). With a
            # window: sparse_mode 4 with the same pre_tokens / next_tokens, per document.
            self.fa_tnd = FlashAttentionScore(head_num=h, keep_prob=1.0, scale_value=1.0 / math.sqrt(d),
                                              pre_tokens=window - 1 if band else 2147483647,
                                              next_tokens=0 if band else 2147483647,
                                              inner_precise=0, input_layout="TND", sparse_mode=4 if band else 3)
        self.scale = 1.0 / math.sqrt(d)
        self.softmax_dtype = ms_dtype(config.softmax_compute_type)
        self.compute_dtype = ms_dtype(config.compute_dtype)
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()
        self.cast = ops.Cast()
        # rotary: x * cos + rotate_half(x) * sin
        self.mul_cos = ops.Mul()
        self.mul_sin = ops.Mul()
        self.add_rope = ops.Add()
        self.neg = ops.Neg()
        self.concat = ops.Concat(-1)
        # rotate_half's split of D in two, one primitive so the layout can shard it like its input
        # (slicing syntax gave MindSpore a StridedSlice without strategy, redistributed by AllGathers
        # over the model-parallel group in every layer: docs/dryrun.md)
        self.split_half = ops.Split(-1, 2)
        # (B, H, T, D) -> (B, T, H, D) after attention: its own primitive, so it carries its own
        # strategy (the q/k/v transpose's splits axis 2 of a (B, T, H, D) input); repeat_kv's copy of
        # each key/value head: Tile, shardable over the kv heads (broadcast_to had no strategy).
        # Both were MindSpore redistributions (AllGathers over the model-parallel group) per layer.
        self.transpose_out = ops.Transpose()
        self.tile_kv = ops.Tile()
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()
        self.mul_scale = ops.Mul()
        self.add_mask = ops.Add()
        self.softmax = ops.Softmax(-1)
        self.flat_softmax = fast_paths
        self.kv_cache = KVCache()

    def rotate(self, x, cos, sin):
        """x (B, N, T, D); cos/sin (T, D) or per row (B, 1, T, D) -> (B, N, T, D)."""
        x1, x2 = self.split_half(x)                               # (B, N, T, D/2) each
        rotated = self.concat((self.neg(x2), x1))                 # rotate_half(x)
        return self.add_rope(self.mul_cos(x, cos), self.mul_sin(rotated, sin))

    def repeat_kv(self, x):
        """(B, K, T, D) -> (B, H, T, D): each key/value head serves n_rep query heads."""
        if self.n_rep == 1:
            return x
        b, k, t, d = x.shape
        x = self.tile_kv(self.reshape(x, (b, k, 1, t, d)), (1, 1, self.n_rep, 1, 1))   # (B, K, n_rep, T, D)
        return self.reshape(x, (b, k * self.n_rep, t, d))

    def heads(self, x2d, b, t):
        """x (B*T, C) -> q (B, T, H, D), k (B, T, K, D) (q/k-normed with ``qk_norm``), v (B, T, K, D)."""
        q = self.reshape(self.q_proj(x2d), (b, t, self.n_heads, self.head_dim))
        k = self.reshape(self.k_proj(x2d), (b, t, self.n_kv, self.head_dim))
        v = self.reshape(self.v_proj(x2d), (b, t, self.n_kv, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def project(self, x, cos, sin, scale_q=True):
        """x (B, T, C) -> q (B, H, T, D) rotated (and scaled by 1/sqrt(D) with ``scale_q``),
        k (B, K, T, D) rotated, v (B, K, T, D)."""
        b, t, c = x.shape
        q, k, v = self.heads(self.reshape(x, (b * t, c)), b, t)
        q = self.transpose(q, (0, 2, 1, 3))
        k = self.transpose(k, (0, 2, 1, 3))
        v = self.transpose(v, (0, 2, 1, 3))
        q = self.rotate(q, cos, sin)                                                   # (B, H, T, D)
        if scale_q:
            # 1/sqrt(D) applied to q (B, H, T, D) rather than to the scores (B, H, T, T): T/D times
            # fewer multiplies, forward and backward
            q = self.mul_scale(q, self.scale)
        return q, self.rotate(k, cos, sin), v

    def attend(self, q, k, v, mask):
        """q (B, H, T, D), k/v (B, K, S, D), additive mask broadcastable to (B, H, T, S)
        -> (B, T, C)."""
        b, _, t, _ = q.shape
        s = k.shape[2]
        k = self.repeat_kv(k)                                                          # (B, H, S, D)
        v = self.repeat_kv(v)                                                          # (B, H, S, D)
        scores = self.bmm_qk(q, k)                                                     # (B, H, T, S)
        scores = self.add_mask(self.cast(scores, self.softmax_dtype), mask)
        if self.flat_softmax:  # CPU: softmax + its gradient on (B*H*T, S) run 25-30% faster than 4-D
            probs = self.reshape(self.softmax(self.reshape(scores, (-1, s))), (b, self.n_heads, t, s))
        else:
            probs = self.softmax(scores)
        probs = self.cast(probs, self.compute_dtype)
        out = self.bmm_pv(probs, v)                                                    # (B, H, T, D)
        out = self.reshape(self.transpose_out(out, (0, 2, 1, 3)), (b * t, self.n_heads * self.head_dim))
        return self.reshape(self.o_proj(out), (b, t, self.hidden))                     # (B, T, C)

    def attend_flash(self, x, cos, sin):
        """msllm's CPU kernels: x (B, T, C) -> (B, T, C), causal (and windowed), no transposes,
        no (B, H, T, T)."""
        b, t, c = x.shape
        q, k, v = self.heads(self.reshape(x, (b * t, c)), b, t)                        # (B, T, H|K, D)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        out, _ = self.flash(q, k, v, self.window)                                      # (B, T, H, D)
        out = self.o_proj(self.reshape(out, (b * t, self.n_heads * self.head_dim)))    # (B*T, C)
        return self.reshape(out, (b, t, self.hidden))

    def attend_fa_score(self, x, cos, sin):
        """MindSpore's FlashAttentionScore (Ascend): x (B, T, C) -> (B, T, C), causal."""
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin, scale_q=False)                            # (B, H|K, T, D)
        _, _, _, out = self.fa_score(q, k, v, None, None, None, self.fa_mask, None)   # (B, H, T, D)
        out = self.reshape(self.transpose_out(out, (0, 2, 1, 3)), (b * t, self.n_heads * self.head_dim))
        return self.reshape(self.o_proj(out), (b, t, self.hidden))                     # (B, T, C)

    def attend_flash_docs(self, x, cos, sin, start):
        """Packed rows on msllm's CPU kernels: x (B, T, C), cos/sin (B*T, D) (each slot's own
        position), start (B, T) float32 (each slot's document start) -> (B, T, C)."""
        b, t, c = x.shape
        d = self.head_dim
        q, k, v = self.heads(self.reshape(x, (b * t, c)), b, t)                        # (B, T, H|K, D)
        q = self.reshape(self.rope(self.reshape(q, (1, b * t, self.n_heads, d)), cos, sin), (b, t, self.n_heads, d))
        k = self.reshape(self.rope(self.reshape(k, (1, b * t, self.n_kv, d)), cos, sin), (b, t, self.n_kv, d))
        out, _ = self.flash_docs(q, k, v, self.window, start)                          # (B, T, H, D)
        out = self.o_proj(self.reshape(out, (b * t, self.n_heads * d)))                # (B*T, C)
        return self.reshape(out, (b, t, self.hidden))

    def attend_fa_tnd(self, x, cos, sin, cu_seqlens):
        """Packed rows on MindSpore's FlashAttentionScore (Ascend), layout TND: x (B, T, C), cos/sin
        (B, 1, T, D), cu_seqlens (B*N,) int64 cumulative document ends over the B*T tokens
        -> (B, T, C)."""
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self.project(x, cos, sin, scale_q=False)                            # (B, H|K, T, D)
        q = self.reshape(self.transpose(q, (0, 2, 1, 3)), (b * t, self.n_heads, d))   # (B*T, H, D)
        k = self.reshape(self.transpose(k, (0, 2, 1, 3)), (b * t, self.n_kv, d))
        v = self.reshape(self.transpose(v, (0, 2, 1, 3)), (b * t, self.n_kv, d))
        _, _, _, out = self.fa_tnd(q, k, v, None, None, None, self.fa_mask, None, cu_seqlens, cu_seqlens)
        out = self.reshape(out, (b * t, self.n_heads * d))                             # (B*T, H*D)
        return self.reshape(self.o_proj(out), (b, t, self.hidden))

    def construct(self, x, cos, sin, mask, docs=None):
        """x (B, T, C) -> (B, T, C). Unpacked rows: cos/sin (T, D), mask (T, T). Packed rows
        (``docs`` not None, :meth:`LlamaModel.document_inputs`): the flash kernel takes cos/sin
        (B*T, D) and docs = each slot's document start (B, T) float32; FlashAttentionScore takes
        cos/sin (B, 1, T, D) and docs = the TND cumulative ends (B*N,) int64; the composed
        operators take cos/sin (B, 1, T, D) and the block-diagonal mask (B, 1, T, T)."""
        if self.flash is not None:
            if docs is None:
                return self.attend_flash(x, cos, sin)
            return self.attend_flash_docs(x, cos, sin, docs)
        if self.fa_score is not None:
            if docs is None:
                return self.attend_fa_score(x, cos, sin)
            return self.attend_fa_tnd(x, cos, sin, docs)
        q, k, v = self.project(x, cos, sin)
        return self.attend(q, k, v, mask)                                              # causal mask (T, T)

    def construct_cached(self, x, cos, sin, mask, k_cache, v_cache, index, fresh=False, start=None):
        """x (B, T, C); cos/sin (B, 1, T, D); mask (B, 1, T, S); caches (S * B, K, D) Parameters;
        index (T, B) int32 cache rows -> out (B, T, C), with x's keys/values written into the
        caches' rows in place (:class:`~msllm.models.llama.kv_cache.KVCache`).
        ``fresh`` (a compile-time constant): a prefill whose tokens attend over their own keys
        only (every other slot of their rows is empty or masked), so attending over x's own keys
        gives the same output at O(T^2), not O(T S) (with chat's whole-context buffer that was
        most of the first token's time: benchmarks/ttft_prefill.py), and x's rows may be some of
        the cache's rows (``index`` names them: a new request prefilled into a free row); ``start``
        (B,) float32 with ``fresh``: each row's first real slot (left padding), for msllm's flash
        kernel (:meth:`prefill_flash`)."""
        b, t, c = x.shape
        if t == 1 and not fresh and self.decode_attention is not None and self.softmax_dtype == ms.float32:
            return self.decode_one(x, cos, sin, mask, k_cache, v_cache, index)
        if not fresh and self.decode_attention is not None and self.softmax_dtype == ms.float32:
            return self.extend_kernel(x, cos, sin, mask, k_cache, v_cache, index)
        if fresh and start is not None and self.flash is not None:
            return self.prefill_flash(x, cos, sin, k_cache, v_cache, index, start)
        q, k, v = self.project(x, cos, sin)                                            # (B, H|K, T, D)
        k_cache = self.kv_cache(k_cache, self.transpose(k, (2, 0, 1, 3)), index)        # (T, B, K, D) in
        v_cache = self.kv_cache(v_cache, self.transpose(v, (2, 0, 1, 3)), index)
        if fresh:
            # attends over x's own keys; the depends keep the cache writes (a write whose result
            # no output uses is pruned from the graph)
            out = self.attend(q, k, v, mask[:, :, :, :t])
            return ops.depend(ops.depend(out, k_cache), v_cache)
        return self.attend(q, self.kv_cache.heads_first(k_cache, b), self.kv_cache.heads_first(v_cache, b), mask)

    def rotated_into_cache(self, x, cos, sin, k_cache, v_cache, index):
        """The kernel paths' common front for T tokens per row: x (B, T, C) -> q (B, T, H, D), k, v
        (B, T, K, D), rotary by the ``rope`` kernel over the B*T (row, slot) pairs (each with its own
        position's table row), keys and values written into the caches at ``index``; returns
        (q, k, v, k_cache, v_cache)."""
        b, t, c = x.shape
        d = self.head_dim
        q, k, v = self.heads(self.reshape(x, (b * t, c)), b, t)                      # (B, T, H|K, D)
        cos, sin = self.reshape(cos, (b * t, d)), self.reshape(sin, (b * t, d))       # per (row, slot)
        q = self.reshape(self.rope(self.reshape(q, (1, b * t, self.n_heads, d)), cos, sin), (b, t, self.n_heads, d))
        k = self.reshape(self.rope(self.reshape(k, (1, b * t, self.n_kv, d)), cos, sin), (b, t, self.n_kv, d))
        k_cache = self.kv_cache(k_cache, self.transpose(k, (1, 0, 2, 3)), index)     # (T, B, K, D) in
        v_cache = self.kv_cache(v_cache, self.transpose(v, (1, 0, 2, 3)), index)
        return q, k, v, k_cache, v_cache

    def prefill_flash(self, x, cos, sin, k_cache, v_cache, index, start):
        """A prefill of left-padded rows on msllm's CPU kernels: x (B, T, C) -> (B, T, C). Rotary
        by the ``rope`` kernel over the B*T (row, slot) pairs, each with its own position's table
        row; causal (and windowed) attention by ``flash_attention_padded``, row b's keys from
        slot ``start[b]`` (what the additive mask says, without the (B, H, T, T) scores: the
        composed attention was ~30% of SmolLM2's 512-token prefill; BENCHMARKS.md)."""
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v, k_cache, v_cache = self.rotated_into_cache(x, cos, sin, k_cache, v_cache, index)
        out = self.flash_padded(q, k, v, self.window, start)                          # (B, T, H, D)
        out = self.o_proj(self.reshape(out, (b * t, self.n_heads * d)))               # (B*T, C)
        out = self.reshape(out, (b, t, self.hidden))
        return ops.depend(ops.depend(out, k_cache), v_cache)    # keep the cache writes (see above)

    def extend_kernel(self, x, cos, sin, mask, k_cache, v_cache, index):
        """T > 1 new tokens per row over a cache holding earlier ones (a suffix after a cached
        prefix, a chunk of a long prompt) on msllm's CPU kernels: x (B, T, C) -> (B, T, C). Rotary
        as in :meth:`prefill_flash`, the keys and values written into the caches, then
        ``decode_attention`` with each query's own mask row (B, 1, T, S) straight from the flat
        caches: no (B, H, T, S) score tensors in the graph (the composed path kept about
        5,400 x T x S bytes per graph for SmolLM2's 30 layers: 2.9 GB at T = 512, S = 1024)."""
        b, t, _ = x.shape
        d = self.head_dim
        # the new keys and values are read back from the caches: only q and the written caches
        # are taken from the tuple (unused items of it are side-effect nodes MindSpore warns about)
        front = self.rotated_into_cache(x, cos, sin, k_cache, v_cache, index)
        q, k_cache, v_cache = front[0], front[3], front[4]
        q = self.mul_scale(self.transpose(q, (0, 2, 1, 3)), self.scale)              # (B, H, T, D)
        out = self.decode_attention(q, k_cache, v_cache, self.cast(mask, ms.float32))  # (B, H, T, D)
        out = self.reshape(self.transpose(out, (0, 2, 1, 3)), (b * t, self.n_heads * d))
        return self.reshape(self.o_proj(out), (b, t, self.hidden))

    def decode_one(self, x, cos, sin, mask, k_cache, v_cache, index):
        """One new token per row on msllm's CPU kernels: x (B, 1, C) -> (B, 1, C). The heads stay
        in the projections' layout (with T = 1, (B, 1, N, D) is (B, N, 1, D) and (1, B, N, D) in
        memory, so no transposes), rotary by the ``rope`` kernel with each row's own position as a
        table row, attention by ``decode_attention`` straight from the (S * B, K, D) caches: a
        decode step is ~15 operator launches per layer instead of ~30 (MindSpore's launch cost
        per operator is tens of microseconds on CPU). The dense SwiGLU block runs its decode step
        in two fused operators instead (:meth:`DecoderLayer.decode_fused`); this path serves the
        other family members."""
        b, _, c = x.shape
        q, k, v = self.heads(self.reshape(x, (b, c)), b, 1)                          # (B, 1, H|K, D)
        d = self.head_dim
        cos, sin = self.reshape(cos, (b, d)), self.reshape(sin, (b, d))               # row b's position
        q = self.rope(self.reshape(q, (1, b, self.n_heads, d)), cos, sin)            # (1, B, H, D)
        k = self.rope(self.reshape(k, (1, b, self.n_kv, d)), cos, sin)               # (1, B, K, D)
        q = self.mul_scale(self.reshape(q, (b, self.n_heads, 1, d)), self.scale)     # (B, H, 1, D)
        k_cache = self.kv_cache(k_cache, k, index)                                    # row index[0, b]
        v_cache = self.kv_cache(v_cache, self.reshape(v, (1, b, self.n_kv, d)), index)
        out = self.decode_attention(q, k_cache, v_cache, self.cast(mask, ms.float32))  # (B, H, 1, D)
        out = self.o_proj(self.reshape(out, (b, self.n_heads * d)))                  # (B, C)
        return self.reshape(out, (b, 1, self.hidden))


class MLP(nn.Cell):
    """Gated feed-forward (Shazeer 2020, "GLU Variants"): ``down(act(gate(x)) * up(x))``;
    (N, C) -> (N, C). ``hidden_act``: ``silu`` (SwiGLU, LLaMA) or ``gelu_pytorch_tanh`` (GeGLU,
    Gemma; MindSpore's ``GeLU`` primitive is the tanh approximation, equal to torch's
    ``gelu(approximate="tanh")`` within 1.2e-7 on [-5, 5])."""

    def __init__(self, config: LlamaConfig, kernels=None, width=None):
        super().__init__()
        c, f, std = config.hidden_size, width or config.ffn_size, config.initializer_range
        self.gate_proj = Linear(c, f, config, std, kernels)
        self.up_proj = Linear(c, f, config, std, kernels)
        self.down_proj = Linear(f, c, config, std, kernels)
        self.sigmoid = ops.Sigmoid()  # silu(g) = g * sigmoid(g); MindSpore 2.10 has no SiLU primitive
        self.mul_silu = ops.Mul()
        self.mul = ops.Mul()
        self.gelu = ops.GeLU() if config.hidden_act == "gelu_pytorch_tanh" else None
        # fused path: msllm/kernels/csrc/elementwise.cc (silu(g) * u and its gradient in one pass)
        self.swiglu = kernels.swiglu if kernels is not None and self.gelu is None else None

    def construct(self, x):
        gate = self.gate_proj(x)                                                   # (N, F)
        if self.swiglu is not None:
            return self.down_proj(self.swiglu(gate, self.up_proj(x)))              # (N, C)
        act = self.gelu(gate) if self.gelu is not None else self.mul_silu(gate, self.sigmoid(gate))
        return self.down_proj(self.mul(act, self.up_proj(x)))                      # (N, C)


class DecoderLayer(nn.Cell):
    """Pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h)); (B, T, C) -> (B, T, C).

    Layer ``index`` has a mixture-of-experts MLP when ``config.is_moe_layer(index)``
    (:class:`~msllm.models.llama.moe.SparseMoE`); ``construct`` then returns (x', counts (E,),
    probs (E,), dropped ()), the router statistics of the load-balancing loss and the token choices
    the capacity dropped (``is_moe``, a constant)."""

    def __init__(self, config: LlamaConfig, fast_paths: bool = False, choice: KernelChoice | None = None,
                 index: int = 0):
        super().__init__()
        kern, norm = (choice.cpu, choice.norm) if choice is not None else (None, "")
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, config, fast_paths, norm, kern)
        self.self_attn = Attention(config, fast_paths, choice, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, config, fast_paths, norm, kern)
        self.is_moe = config.is_moe_layer(index)
        if self.is_moe:
            std = config.initializer_range
            self.mlp = SparseMoE(config, lambda i, o: Linear(i, o, config, std, kern),
                                 lambda width: MLP(config, kern, width), ms_dtype(config.param_init_type),
                                 ms_dtype(config.compute_dtype), kern)
        else:
            self.mlp = MLP(config, kern)
        self.add_attn = ops.Add()
        self.add_mlp = ops.Add()
        self.reshape = ops.Reshape()
        # a decode step (one new token per row) in two of msllm's operators instead of ~15
        # (csrc/decode_fused.cc; MindSpore's launch of each operator costs more than most of their
        # work at batch 1): for the dense SwiGLU block without biases, q/k norms or a norm offset;
        # every other family member keeps the operator-by-operator path (decode_one)
        self.decode_front = self.decode_back = None
        if (kern is not None and norm == CPU_NORM and not self.is_moe and self.mlp.swiglu is not None
                and not config.qk_norm and float(config.rms_norm_offset) == 0.0 and not config.qkv_bias
                and not config.o_bias and config.softmax_compute_type == "float32"
                and config.compute_dtype == "float32"):
            h, k, d = config.num_heads, config.kv_heads, config.head_dim
            self.decode_front, self.decode_back = kern.decode_front(h, k, d), kern.decode_back
            self.attn_scale = Tensor(np.array([1.0 / math.sqrt(d)], np.float32))   # as Attention.scale

    def fused_decode_ok(self):
        """True when :meth:`decode_fused` serves this layer's decode step: the fused operators are
        built and every projection is a plain :class:`Linear` (not wrapped, e.g. by LoRA)."""
        if self.decode_front is None:
            return False
        a, m = self.self_attn, self.mlp
        plain = (a.q_proj.fusable and a.k_proj.fusable and a.v_proj.fusable and a.o_proj.fusable
                 and m.gate_proj.fusable and m.up_proj.fusable and m.down_proj.fusable)
        # stacked weights (msllm/models/llama/stacked.py): only the model's one decode operator reads them
        return plain and a.q_proj.layer_index is None

    def front_weights(self):
        """The fused front's weights as csrc/decode_fused.cc reads them: input norm weight and eps,
        then the q / k / v weights (each ``Linear.decode_weights()``)."""
        a, n1 = self.self_attn, self.input_layernorm
        return ((n1.weight, n1.eps_tensor) + a.q_proj.decode_weights() + a.k_proj.decode_weights()
                + a.v_proj.decode_weights())

    def back_weights(self):
        """The fused back's weights as csrc/decode_fused.cc reads them: the o weight, post-attention
        norm weight and eps, then the gate / up / down weights."""
        m, n2 = self.mlp, self.post_attention_layernorm
        return (self.self_attn.o_proj.decode_weights() + (n2.weight, n2.eps_tensor) + m.gate_proj.decode_weights()
                + m.up_proj.decode_weights() + m.down_proj.decode_weights())

    def decode_inputs(self, k_cache, v_cache):
        """This layer's part of :meth:`LlamaModel.decode_layers`' one operator (csrc/decode_fused.cc
        ``msllm_decode_stack``): the front's weights, the caches, the back's weights."""
        return self.front_weights() + (k_cache, v_cache) + self.back_weights()

    def decode_fused(self, x, cos, sin, mask, k_cache, v_cache, index):
        """One new token per row, x (B, 1, C) -> (B, 1, C), in msllm's two fused operators, the
        front writing the new keys and values into the caches' rows in place (csrc/decode_fused.cc
        says why that is safe); the same arithmetic and cache contents as
        :meth:`Attention.decode_one` + :meth:`feed_forward` (cos / sin (B, 1, 1, D), mask
        (B, 1, 1, S) float32, caches (S * B, K, D) float32, index (1, B) int32)."""
        front = (x,) + self.front_weights() + (cos, sin, self.attn_scale, k_cache, v_cache, index)
        q, _, _ = self.decode_front(*front)                  # (B, H, 1, D); k, v written at rows index[0, b]
        return self.decode_back(*((x, q, k_cache, v_cache, mask) + self.back_weights()))   # (B, 1, C)

    def feed_forward(self, x, a):
        """x (B, T, C) and the attention output a (B, T, C) -> h + mlp(norm(h)) with h = x + a."""
        b, t, c = x.shape
        if self.post_attention_layernorm.fused_add is not None:  # residual add inside the norm kernel
            h, normed = self.post_attention_layernorm.add_and_norm(x, a)           # (B, T, C) each
        else:
            h = self.add_attn(x, a)
            normed = self.post_attention_layernorm(h)
        if self.is_moe:
            m, counts, probs, dropped = self.mlp(self.reshape(normed, (b * t, c)))  # (B*T, C), (E,), (E,), ()
            return self.add_mlp(h, self.reshape(m, (b, t, c))), counts, probs, dropped
        m = self.mlp(self.reshape(normed, (b * t, c)))                             # (B*T, C)
        return self.add_mlp(h, self.reshape(m, (b, t, c)))

    def construct(self, x, cos, sin, mask, docs=None):
        return self.feed_forward(x, self.self_attn(self.input_layernorm(x), cos, sin, mask, docs))

    def construct_cached(self, x, cos, sin, mask, k_cache, v_cache, index, fresh=False, start=None):
        """As ``construct`` for new tokens x (B, T, C) over a cache (written in place); returns x'
        (``index``, ``fresh``, ``start``: :meth:`Attention.construct_cached`)."""
        if x.shape[1] == 1 and not fresh and self.fused_decode_ok():
            return self.decode_fused(x, cos, sin, mask, k_cache, v_cache, index)
        a = self.self_attn.construct_cached(self.input_layernorm(x), cos, sin, mask, k_cache, v_cache, index, fresh,
                                            start)
        if self.is_moe:
            return self.feed_forward(x, a)[0]
        return self.feed_forward(x, a)


class LlamaModel(nn.Cell):
    """Embedding + decoder layers + final norm: token ids (B, T) int32 -> hidden (B, T, C).

    ``choice``: the fused operators to build (default :func:`msllm.kernels.select.choose` for
    ``config``, ``fast_paths`` and ``device``, logged)."""

    def __init__(self, config: LlamaConfig, fast_paths: bool = False, choice: KernelChoice | None = None,
                 device: str = "CPU"):
        super().__init__()
        if choice is None:
            choice = choose(config, fast_paths, device)
            log.info(choice.describe())
        self.config = config
        embed_dtype = ms_dtype(config.embedding_init_type or config.param_init_type)
        # the table's initializer is made in the table's dtype: a float32 one cast afterwards
        # (set_dtype) stays float32 under no_init_parameters, and MindSpore's pipeline clones its
        # gradient accumulator from it (the dry-run found a float32 accumulator for a float16 table:
        # 625 MiB on a 13B rank; benchmarks/results/dryrun_13b_embedding_accumulator_dtype.txt)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         embedding_table=initializer(Normal(config.initializer_range),
                                                                     [config.vocab_size, config.hidden_size],
                                                                     embed_dtype),
                                         dtype=ms.int32)
        # MindSpore 2.10's CPU Gather has no bfloat16 kernel: a bf16 table is read by msllm's
        # lookup kernel (inference only: it has no gradient)
        self.embed_rows = None
        if choice.cpu is not None and embed_dtype == ms.bfloat16:
            self.embed_rows = choice.cpu.embedding
        self.layers = nn.CellList([DecoderLayer(config, fast_paths, choice, i) for i in range(config.num_layers)])
        # router statistics start from zero (E,) (E = 1 for a dense model: never used)
        experts = config.moe_config.expert_num if config.moe_config is not None else 1
        self.zero_stats = Tensor(np.zeros(experts, np.float32))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config, fast_paths, choice.norm, choice.cpu)
        # rotary angles and masks are computed in the graph for the positions in use: nothing here
        # grows with max_position_embeddings (a (P, P) mask of Llama 3.1's 131,072 positions is 64 GiB)
        inv_freq, self.rope_factor = rotary_frequencies(config)
        self.inv_freq = Tensor(inv_freq[None, :], ms.float32)                  # (1, D/2)
        self.mask_dtype = ms_dtype(config.softmax_compute_type)
        self.attention_kind = choice.attention   # how packed rows' documents reach the attention
        # one mask per distinct window; layer i uses masks[self.mask_of[i]]
        windows = [config.layer_window(i) for i in range(config.num_layers)]
        self.windows = tuple(dict.fromkeys(windows))
        self.mask_of = tuple(self.windows.index(w) for w in windows)
        # a decode step's decoder layers as one of msllm's operators (csrc/decode_fused.cc
        # msllm_decode_stack) when every layer has the fused two and all share one mask: one launch
        # instead of two per layer (decode_layers)
        self.decode_stack = None
        if (choice.cpu is not None and choice.cpu.decode_stack_enabled() and len(self.windows) == 1
                and all(layer.decode_front is not None for layer in self.layers)):
            self.decode_stack = choice.cpu.decode_stack
            self.attn_scale = self.layers[0].attn_scale
        # the norms' weights (L, C) each once the layers' weights are stacked for decode_stack
        # (msllm/models/llama/stacked.py); None: each layer's own
        self.stacked_norms = None
        # Gemma's embedding scale, rounded to the weights' dtype first as HF does
        self.embed_scale = Tensor(config.embedding_multiplier, embed_dtype)
        self.scale_embed = config.embedding_multiplier != 1.0
        self.mul_embed = ops.Mul()
        self.compute_dtype = ms_dtype(config.compute_dtype)
        self.cast = ops.Cast()
        self.reshape = ops.Reshape()

    def embed(self, input_ids):
        """token ids (B, T) int32 -> embeddings (B, T, C) in compute dtype (times
        ``embedding_multiplier`` in the weights' dtype when it is not 1)."""
        if self.embed_rows is not None:  # bfloat16 table on CPU: msllm's lookup, float32 rows
            x = self.embed_rows(self.embed_tokens.embedding_table, input_ids)     # (B, T, C)
            if self.scale_embed:
                x = self.mul_embed(x, self.cast(self.embed_scale, ms.float32))
            return self.cast(x, self.compute_dtype)
        x = self.embed_tokens(input_ids)                                        # (B, T, C)
        if self.scale_embed:
            x = self.mul_embed(x, self.embed_scale)
        return self.cast(x, self.compute_dtype)

    def construct(self, input_ids, actual_seq_len=None):
        return self.forward_with_router(input_ids, actual_seq_len)[0]

    def forward_with_router(self, input_ids, actual_seq_len=None):
        """token ids (B, T) -> (hidden (B, T, C), counts (E,), probs (E,), dropped ()): the MoE
        layers' router statistics and dropped token choices summed over the layers (zeros for a
        dense model). ``actual_seq_len`` (B, N) int32: packed rows' document ends
        (:mod:`~msllm.models.llama.batch_layout`): positions restart and attention stays inside
        each document; None: one sequence per row (this graph is then unchanged)."""
        b, t = input_ids.shape
        x = self.embed(input_ids)                                               # (B, T, C)
        docs = None
        if actual_seq_len is None:
            pos = causal_positions(t)                                           # (1, T)
            cos, sin = self.rotary(pos)                                         # (1, T, D)
            cos, sin = cos[0], sin[0]                                           # (T, D)
            masks = self.masks(pos, pos)                                        # each (1, 1, T, T)
        else:
            cos, sin, masks, docs = self.document_inputs(actual_seq_len, b, t)
        counts, probs, dropped = self.zero_stats, self.zero_stats, self.zero_stats.sum()
        i = 0
        for layer in self.layers:
            mask = masks[self.mask_of[i]]
            if actual_seq_len is None:
                # (T, T) and (T, D): the shapes msllm.parallel.layout_rules' strategies are written for
                mask = mask[0, 0]
            if layer.is_moe:
                x, c, p, d = layer(x, cos, sin, mask, docs)
                counts, probs, dropped = counts + c, probs + p, dropped + d
            else:
                x = layer(x, cos, sin, mask, docs)
            i += 1
        return self.norm(x), counts, probs, dropped

    def document_inputs(self, actual_seq_len, b, t):
        """Packed rows: (cos, sin, masks, docs) for the attention path in use (shapes in
        :meth:`Attention.construct`); masks are built for the composed path only."""
        segment, start, pos = document_layout(actual_seq_len, t)               # (B, T) each
        cos, sin = self.rotary(pos)                                             # (B, T, D)
        masks = (None,) * len(self.windows)
        if self.attention_kind == CPU_FLASH:
            return self.reshape(cos, (b * t, -1)), self.reshape(sin, (b * t, -1)), masks, start
        cos, sin = cos[:, None], sin[:, None]                                   # (B, 1, T, D)
        if self.attention_kind == ASCEND_FLASH:
            # TND: row r's ends shifted by r * T; the padding ends (T) close each row, and the
            # model appends one T per row so the last length is always B * T
            ends = ops.concat((ops.cast(actual_seq_len, ms.int64), ops.fill(ms.int64, (b, 1), t)), 1)
            offsets = ops.reshape(ops.arange(0, b, dtype=ms.int64) * t, (b, 1))
            return cos, sin, masks, self.reshape(ends + offsets, (-1,))
        return cos, sin, tuple(document_mask(segment, w, self.mask_dtype) for w in self.windows), None

    def rotary(self, positions):
        """positions (B, T) int32 -> cos, sin (B, T, D) in compute dtype: the angles
        ``position * inv_freq`` in float32 (as transformers' ``LlamaRotaryEmbedding``), duplicated
        along the last axis (HF "rotate_half" layout), times the rope scaling's attention factor
        (:func:`~msllm.models.llama.rotary.rotary_frequencies`)."""
        angles = self.cast(positions, ms.float32)[:, :, None] * self.inv_freq   # (B, T, D/2)
        angles = ops.concat((angles, angles), -1)                                # (B, T, D)
        cos, sin = ops.cos(angles), ops.sin(angles)
        if self.rope_factor != 1.0:
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        return self.cast(cos, self.compute_dtype), self.cast(sin, self.compute_dtype)

    def masks(self, key_positions, positions):
        """key positions (B, S) and query positions (B, T) int32 -> one additive mask (B, 1, T, S)
        per distinct layer window (:func:`~msllm.models.llama.batch_layout.additive_mask`)."""
        return tuple(additive_mask(key_positions, positions, w, self.mask_dtype) for w in self.windows)

    def forward_cached(self, input_ids, positions, key_positions, index, caches, fresh=False):
        """New tokens over a cache -> hidden (B, T, C); the new keys and values are written into
        ``caches`` in place.

        input_ids / positions (B, T) int32 (each row's own positions, so left padding is
        invisible to the rotary embedding); key_positions (B, S) int32: the position of the token
        in each of the row's S cache slots, -1 where the row sees nothing (padding, an empty row),
        from which each layer's mask is built (:mod:`~msllm.models.llama.batch_layout`); index (T, B) int32: the cache row of each new token
        (:func:`~msllm.models.llama.kv_cache.cache_index`); caches: ``2 * num_layers`` Parameters
        (S * B', K, D), keys then values per layer (:func:`~msllm.models.llama.kv_cache.empty_cache`;
        B' = B except with ``fresh``, whose rows may be some of the cache's);
        ``fresh``: a prefill of left-padded rows that attend over their own tokens only (a
        compile-time constant, :meth:`Attention.construct_cached`).
        """
        b, t = input_ids.shape
        x = self.embed(input_ids)                                               # (B, T, C)
        cos, sin = self.rotary(positions)                                       # (B, T, D)
        cos, sin = cos[:, None], sin[:, None]                                   # (B, 1, T, D)
        masks = self.masks(key_positions, positions)                            # each (B, 1, T, S)
        start = None
        if fresh:  # left padding: a row's last slot holds position n - 1, so its first real slot is T - n
            start = self.cast(t - 1 - positions[:, t - 1], ms.float32)              # (B,)
        if t == 1 and not fresh and self.decode_layers_ok():
            return self.norm(self.decode_layers(x, cos, sin, masks[0], caches, index))
        i = 0
        for layer in self.layers:
            x = layer.construct_cached(x, cos, sin, masks[self.mask_of[i]], caches[2 * i], caches[2 * i + 1],
                                       index, fresh, start)
            i += 1
        return self.norm(x)

    def decode_layers_ok(self):
        """True when :meth:`decode_layers` serves a decode step: its operator is built and every
        layer's projections are plain :class:`Linear` (``DecoderLayer.fused_decode_ok``)."""
        if self.decode_stack is None:
            return False
        if self.stacked_norms is not None:   # stacked weights: decode_stack's second layout
            return True
        for layer in self.layers:
            if not layer.fused_decode_ok():
                return False
        return True

    def stacked_decode_weights(self):
        """The weight inputs of ``msllm_decode_stack`` in its stacked layout (csrc/decode_fused.cc), in order:
        norm weight (L, C), eps (1,), Wq, Wk, Wv, Wo (each ``Linear.decode_weights()``: (L, out, in), or int8's
        three), norm weight (L, C), eps, Wgate, Wup, Wdown; for :meth:`decode_layers` and the generator's
        direct step (msllm/generation/direct_step.py). Only with stacked weights (``stacked_norms`` set)."""
        first = self.layers[0]
        a, m = first.self_attn, first.mlp
        return ((self.stacked_norms[0], first.input_layernorm.eps_tensor) + a.q_proj.decode_weights()
                + a.k_proj.decode_weights() + a.v_proj.decode_weights() + a.o_proj.decode_weights()
                + (self.stacked_norms[1], first.post_attention_layernorm.eps_tensor)
                + m.gate_proj.decode_weights() + m.up_proj.decode_weights() + m.down_proj.decode_weights())

    def decode_layers(self, x, cos, sin, mask, caches, index):
        """One new token per row through every decoder layer in one operator: x (B, 1, C) -> (B, 1,
        C), each layer's new keys and values written into its caches in place; the same code and
        bits as the layers' :meth:`DecoderLayer.decode_fused` one after another (cos / sin (B, 1, 1,
        D), mask (B, 1, 1, S), caches and index as :meth:`forward_cached`)."""
        args = (x, cos, sin, self.attn_scale, mask, index)
        if self.stacked_norms is not None:   # each kind of weight once, stacked over the layers (stacked.py)
            return self.decode_stack(*(args + self.stacked_decode_weights() + tuple(caches)))   # (B, 1, C)
        i = 0
        for layer in self.layers:
            args = args + layer.decode_inputs(caches[2 * i], caches[2 * i + 1])
            i += 1
        return self.decode_stack(*args)                                         # (B, 1, C)


class LlamaForCausalLM(nn.Cell):
    """LLaMA with its output head and next-token loss.

    ``construct(input_ids, labels=None, actual_seq_len=None)``:
        ``actual_seq_len`` (B, N) int32: packed rows' cumulative document ends over the T tokens
            (:mod:`msllm.data.packing`, :mod:`~msllm.models.llama.batch_layout`): positions restart
            and attention stays causal within each document, and the target of a document's last
            token is ignored, so every document's loss terms are those of its own unpacked row.
        input_ids (B, T+1) int32 with labels (B, T+1) int32 -> scalar fp32 mean cross-entropy over
            positions whose target (``labels[:, 1:]``) is not ``ignore_token_id``; tokens are
            ``input_ids[:, :-1]``. This is the MindRecord sample layout of ``llama_preprocess``.
            With experts (``moe_config.aux_loss_factor`` > 0) plus the factor times the
            load-balancing loss of the T tokens' routing (:func:`msllm.models.llama.moe.load_balancing_loss`).
            With experts and :meth:`return_router_stats` on: (loss, stats (E + 2,) float32 without
            gradient: [load-balancing loss, fraction of the token choices the capacity dropped,
            each expert's share of the token choices]).
        input_ids (B, T) alone (and optionally actual_seq_len over those T) -> logits (B, T, V) fp32.

    ``forward_cached(input_ids, positions, key_positions, index, caches, last_only)``: generation with a
    key/value cache written in place (see :meth:`LlamaModel.forward_cached`) -> logits (B, T, V)
    or with ``last_only`` (B, V) fp32.

    ``compact_loss`` (default ``fast_paths``): for the loss, run the output head
    and the softmax only on the K positions that have a target, instead of all B*T. The loss and
    the gradients are the same (ignored positions contribute exactly zero either way); the work
    of the (K, C) x (C, V) head and the (K, V) log-softmax shrinks with K. On the Alpaca SFT data
    44% of the positions have a target (the rest are prompt and padding): head + loss forward
    and backward took 0.33 s instead of 0.73 s on the tiny benchmark shape (0.45 s vs 0.97 s at
    hidden 512; benchmarks/micro_ops.py --which head), the whole training step 1.16-1.36x less.
    K varies per batch, so that part of the graph has a dynamic shape; it is off under operator
    sharding and on Ascend (unmeasured there).
    """

    def __init__(self, config: LlamaConfig, compact_loss: bool | None = None, fast_paths: bool = False,
                 device: str = "CPU"):
        super().__init__()
        self.config = config   # as asked: a DPO reference model is built from it, with the same kernels
        # which fused operators (msllm/kernels/select.py); device = RunConfig.context.device_target
        self.kernels = choose(config, fast_paths, device)
        log.info(self.kernels.describe())
        if self.kernels.bf16_gemms:
            # compute_dtype bfloat16 on the CPU kernels is the precision of their GEMMs (bf16 inputs,
            # float32 sums); every tensor the model itself casts stays float32
            config = dataclasses.replace(config, compute_dtype="float32")
        self.model = LlamaModel(config, fast_paths, self.kernels)
        self.compact_loss = fast_paths if compact_loss is None else compact_loss
        # the compact loss's head takes a row count known only at run time (C++ shape inference,
        # re-inferred at every launch); generation and scoring call :meth:`head` with
        # ``static_rows`` on the plain kernel (float32 or bfloat16 weights)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, config, config.initializer_range,
                                  self.kernels.cpu, dynamic_rows=self.compact_loss)
        self.table_as_stored = self.kernels.cpu is not None   # as Linear.weight_as_stored
        if self.kernels.cpu is None:                     # for tied embeddings
            self.head_matmul = self.head_matmul_static = ops.MatMul(transpose_b=True)
        else:  # fused path: msllm/kernels/csrc/linear.cc
            kern = self.kernels.cpu
            self.head_matmul = kern.linear_dynamic_rows if self.compact_loss else kern.linear
            self.head_matmul_static = kern.linear
        self.loss = CausalLMLoss(config.ignore_token_id, self.kernels.cpu)
        moe = config.moe_config
        self.aux_loss_factor = float(moe.aux_loss_factor) if moe is not None else 0.0
        self.n_experts = moe.expert_num if moe is not None else 1
        self.top_k = moe.num_experts_chosen if moe is not None else 1
        self.moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
        self.count_reducer, self.count_degree = None, 1
        self.router_stats = False
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()
        self.gather_rows = ops.Gather()
        self.concat_rows = ops.Concat(0)
        # appended to the kept rows: row 0 with an ignored target, so that K = 0 (every target
        # ignored) still gives non-empty tensors (MindSpore's CPU Gather gradient fails on empty)
        self.extra_row = Tensor([0], ms.int64)
        self.extra_target = Tensor([config.ignore_token_id], ms.int32)

    def head(self, h, static_rows=False):
        """h (N, C) -> logits (N, V) float32. ``static_rows`` (a compile-time constant): N is known
        when the graph compiles (generation, scoring), so the plain kernel serves it (module
        comment in ``__init__``)."""
        if self.lm_head is None:
            table = self.model.embed_tokens.embedding_table
            if not self.table_as_stored:
                table = self.cast(table, h.dtype)
            out = (self.head_matmul_static if static_rows else self.head_matmul)(h, table)
        else:
            out = self.lm_head(h, static_rows)   # a Linear, or a LoRALinear around it
        return self.cast(out, ms.float32)

    def logits(self, tokens):
        """tokens (B, T) int32 -> logits (B, T, V) float32."""
        return self.logits_of(self.model(tokens))

    def logits_of(self, h):
        """hidden (B, T, C) -> logits (B, T, V) float32."""
        b, t, c = h.shape
        out = self.head(self.reshape(h, (b * t, c)))                            # (B*T, V)
        return self.reshape(out, (b, t, self.config.vocab_size))

    def forward_cached(self, input_ids, positions, key_positions, index, caches, last_only=False, fresh=False):
        """Generation step over a key/value cache (written in place); shapes in
        :meth:`LlamaModel.forward_cached`. Returns logits (B, T, V) float32, or (B, V) of the last
        position with ``last_only``."""
        h = self.model.forward_cached(input_ids, positions, key_positions, index, caches, fresh)  # (B, T, C)
        b, t, c = h.shape
        if last_only:
            return self.head(self.reshape(h[:, t - 1:t, :], (b, c)), True)                # (B, V)
        return self.reshape(self.head(self.reshape(h, (b * t, c)), True), (b, t, self.config.vocab_size))

    def construct(self, input_ids, labels=None, actual_seq_len=None):
        if labels is None:
            if actual_seq_len is None:
                return self.logits(input_ids)
            return self.logits_of(self.model(input_ids, actual_seq_len))
        tokens = input_ids[:, :-1]                                              # (B, T)
        targets = labels[:, 1:]                                                 # (B, T)
        if actual_seq_len is not None:  # packed rows: no target crosses a document
            segment, _, _ = document_layout(actual_seq_len, tokens.shape[1])
            targets = document_targets(targets, segment, self.config.ignore_token_id)
        h, counts, probs, dropped = self.model.forward_with_router(tokens, actual_seq_len)  # (B, T, C), (E,), (E,), ()
        loss = self.lm_loss(h, targets)
        if not self.moe_layers or not (self.aux_loss_factor or self.router_stats):
            return loss
        # load balancing over all B*T rows of every MoE layer (moe.py); the counts of every
        # data-parallel rank's rows with a count reducer (global-batch balancing)
        rows = float(self.moe_layers * tokens.shape[0] * tokens.shape[1])
        count_rows = rows
        if self.count_reducer is not None:
            counts = ops.stop_gradient(self.count_reducer(counts))
            count_rows = rows * self.count_degree
        aux = load_balancing_loss(counts, probs, count_rows, rows, self.n_experts)
        if self.aux_loss_factor:
            loss = loss + self.aux_loss_factor * aux
        if not self.router_stats:
            return loss
        choices = counts.sum()                                                   # k x rows (x ranks)
        stats = ops.concat((ops.reshape(aux, (1,)), ops.reshape(dropped / (rows * self.top_k), (1,)),
                            counts / choices))
        return loss, ops.stop_gradient(stats)

    def set_router_count_reducer(self, reducer, degree: int) -> None:
        """Global-batch load balancing under data parallelism: ``reducer`` maps this rank's
        router counts (E,) float32 to their sum over the ``degree`` data-parallel ranks (an
        all-reduce, :func:`msllm.parallel.apply.apply_data_parallel_moe`); the mean of the ranks'
        losses is then the whole batch's (moe.py). The model itself knows no process group."""
        self.count_reducer, self.count_degree = reducer, int(degree)

    def return_router_stats(self, on: bool = True) -> None:
        """With experts, make ``construct(input_ids, labels)`` return (loss, stats) for the trainer's
        log (see the class docstring); no effect on a dense model."""
        self.router_stats = bool(on) and self.moe_layers > 0

    @property
    def n_router_stats(self) -> int:
        """Length of the stats vector ``construct`` returns beside the loss (0: none)."""
        return self.n_experts + 2 if self.router_stats else 0

    def supervised_rows(self, h, targets):
        """The positions that have a target, for a head run only there (``compact_loss``).

        hidden (B, T, C), targets (B, T) int32 -> (hidden (K+1, C), targets (K+1,) int32, flat
        positions (K+1,) int64 in [0, B*T)): the K positions whose target is not ``ignore_token_id``,
        then position 0 with an ignored target, so that K = 0 still gives non-empty tensors. K varies
        per batch (a dynamic shape). Used by :meth:`lm_loss` and DPO's per-sequence log-probs
        (``msllm/training/dpo.py`` ``SequenceLogps``).
        """
        h = self.reshape(h, (-1, self.config.hidden_size))                     # (B*T, C)
        targets = self.reshape(targets, (-1,))                                  # (B*T,)
        keep = self.reshape(ops.nonzero(targets != self.config.ignore_token_id), (-1,))  # (K,)
        rows = self.concat_rows((keep, self.extra_row))                         # (K+1,)
        targets = self.concat_rows((self.gather_rows(targets, keep, 0), self.extra_target))
        return self.gather_rows(h, rows, 0), targets, rows

    def lm_loss(self, h, targets):
        """hidden (B, T, C), targets (B, T) int32 -> the mean next-token cross-entropy."""
        if not self.compact_loss:
            return self.loss(self.logits_of(h), targets)
        hk, tk, _ = self.supervised_rows(h, targets)                            # (K+1, C), (K+1,)
        return self.loss(self.head(hk), tk)                                     # (K+1, V) logits


class CausalLMLoss(nn.Cell):
    """Mean token cross-entropy ignoring ``ignore_index`` targets.

    logits (B, T, V) (or (N, V)) float32, targets (B, T) (or (N,)) int32 -> scalar float32
    ``sum_i mask_i * (logsumexp(z_i) - z_i[y_i]) / max(sum_i mask_i, 1)``.
    ``kernels``: the per-row logsumexp and its gradient run in msllm's fused CPU kernel.
    """

    def __init__(self, ignore_index: int = -100, kernels=None):
        super().__init__()
        self.ignore_index = ignore_index
        self.log_softmax = ops.LogSoftmax(-1)
        self.gather = ops.GatherD()
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()
        # fused path: msllm/kernels/csrc/loss.cc (two passes over the logits forward, one backward;
        # no (N, V) log-probabilities kept)
        self.cross_entropy = kernels.cross_entropy if kernels is not None else None

    def construct(self, logits, targets):
        v = logits.shape[-1]
        logits = self.reshape(logits, (-1, v))                                  # (N, V)
        if self.cross_entropy is not None:
            targets = self.reshape(targets, (-1,))                              # (N,)
            counted = targets != self.ignore_index
            rows = self.cross_entropy(logits, ops.select(counted, targets, -1 * ops.ones_like(targets)))
            mask = self.cast(counted, ms.float32)                               # (N,)
            return rows[:, 0].sum() / ops.maximum(mask.sum(), 1.0)              # rows: (N, 2) nll, lse
        targets = self.reshape(targets, (-1, 1))                                # (N, 1)
        mask = self.cast(targets != self.ignore_index, ms.float32)              # (N, 1)
        safe = ops.maximum(targets, 0)                                          # ignored -> id 0
        nll = -self.gather(self.log_softmax(logits), 1, safe)                   # (N, 1)
        return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)
