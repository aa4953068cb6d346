"""The LLaMA decoder in MindSpore, readable top to bottom. No parallel code lives here.

Architecture: Touvron et al. 2023 ("LLaMA", "Llama 2"), as in Meta's ``llama/model.py`` and HF
``transformers/models/llama/modeling_llama.py``: token embedding -> L x [RMSNorm -> causal
grouped-query self-attention with rotary position embedding -> residual -> RMSNorm -> SwiGLU MLP
-> residual] -> RMSNorm -> untied output head.

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight`` ...) so the HF
conversion is a rename-free copy; weight matrices are stored ``(out_features, in_features)`` like
``torch.nn.Linear``. Rotary embedding uses the HF "rotate_half" layout (see ``msllm/convert``).

Every operator that a parallel layout may split is a primitive held as an attribute
(``self.matmul``, ``self.bmm_qk`` ...): ``msllm.parallel`` calls ``.shard(...)`` on them and sets
pipeline stages and recompute on the cells, without this file knowing about it.

Two ways through the network: ``construct`` (training and scoring: the whole sequence, causal
mask) and ``forward_cached`` (generation: new tokens only, keys/values of earlier tokens read
from a :class:`~msllm.models.llama.kv_cache.KVCache`, per-row positions and mask so left-padded
batches decode row by row exactly). The training graph never builds the cached path.

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

import logging
import math

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from msllm.kernels.select import ASCEND_FLASH, ASCEND_NORM, CPU_FLASH, CPU_NORM, KernelChoice, choose
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.kv_cache import KVCache

log = logging.getLogger("msllm")

_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def ms_dtype(name: str):
    """MindSpore dtype for a config dtype name (``float32`` / ``float16`` / ``bfloat16``)."""
    return _DTYPES[name]


class Linear(nn.Cell):
    """``y = x @ W^T`` without bias; W: (out_features, in_features) like ``torch.nn.Linear``.

    Input (N, in) in any float dtype, computed in ``compute_dtype``, output (N, out).
    ``kernels`` (:class:`msllm.kernels.ops.CpuKernels`): the product runs on msllm's oneDNN sgemm
    kernel (same arguments, x W^T) instead of MindSpore's CPU MatMul; ``dynamic_rows`` when N is
    known only at run time (the output head under the compact loss).
    """

    def __init__(self, in_features: int, out_features: int, config: LlamaConfig, std: float, kernels=None,
                 dynamic_rows: bool = False):
        super().__init__()
        self.weight = Parameter(initializer(Normal(std), (out_features, in_features),
                                            ms_dtype(config.param_init_type)), name="weight")
        self.compute_dtype = ms_dtype(config.compute_dtype)
        if kernels is None:
            self.matmul = ops.MatMul(transpose_b=True)
        else:  # fused path: msllm/kernels/csrc/linear.cc (oneDNN sgemm from the mindspore wheel)
            self.matmul = kernels.linear_dynamic_rows if dynamic_rows else kernels.linear
        self.cast = ops.Cast()

    def construct(self, x):
        return self.matmul(self.cast(x, self.compute_dtype), self.cast(self.weight, self.compute_dtype))


class RMSNorm(nn.Cell):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * w``.

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
        self.weight = Parameter(initializer("ones", (hidden_size,), ms_dtype(config.param_init_type)),
                                name="weight")
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

    def add_and_norm(self, x, a):
        """With msllm's kernel only: x, a (B, T, C) -> (h = x + a, norm(h)), both (B, T, C)."""
        h, y, _ = self.fused_add(x, a, self.weight, self.eps_tensor)
        return h, y

    def construct(self, x):
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps_tensor)[0]
        if self.ascend_norm is not None:
            return self.ascend_norm(x, self.cast(self.weight, x.dtype))[0]
        dtype, shape = x.dtype, x.shape
        if self.flat:
            x = self.reshape(x, (-1, shape[-1]))                                # (N, C)
        x = self.cast(x, self.norm_dtype)
        x = self.mul(x, self.rsqrt(self.mean(self.square(x), -1) + self.eps))
        out = self.mul_weight(self.cast(x, dtype), self.cast(self.weight, dtype))
        return self.reshape(out, shape) if self.flat else out


def rotary_tables(config: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables, each (max_positions, D) float32, HF "rotate_half" layout.

    ``inv_freq[i] = theta^(-2i/D)`` (Su et al. 2021, RoFormer eq. 15); angles ``pos * inv_freq``
    are duplicated along the last axis as in HF ``LlamaRotaryEmbedding``. ``rope_scaling``:
    ``linear`` divides positions by ``factor`` (HF ``_compute_linear_scaling_rope_parameters``);
    ``llama3`` (Llama 3.1+) divides the frequencies whose wavelength ``2 pi / inv_freq`` exceeds
    ``original_max_position_embeddings / low_freq_factor`` by ``factor``, keeps those below
    ``original / high_freq_factor``, and blends linearly in between (Meta's
    ``apply_scaling`` in llama-models ``reference_impl/model.py``; HF ``_compute_llama3_parameters``).
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))   # (D/2,)
    pos = np.arange(config.max_positions, dtype=np.float64)
    spec = config.rope_scaling or {}
    kind = spec.get("rope_type", spec.get("type"))
    if kind == "linear":
        pos = pos / float(spec["factor"])
    elif kind == "llama3":
        factor, low, high = float(spec["factor"]), float(spec["low_freq_factor"]), float(spec["high_freq_factor"])
        old = float(spec["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv_freq = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    angles = np.outer(pos, inv_freq)                              # (P, D/2)
    angles = np.concatenate([angles, angles], axis=-1)            # (P, D)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class Attention(nn.Cell):
    """Causal grouped-query self-attention with rotary embeddings (Ainslie et al. 2023 for GQA).

    Input x (B, T, C); output (B, T, C). K = n_kv_heads key/value heads are shared by H / K
    query heads each. ``construct`` attends causally within x; ``construct_cached`` appends x's
    keys/values to a cache of S slots and attends over the cache under a given mask.

    ``choice.attention`` (:func:`msllm.kernels.select.choose`) picks how ``construct`` attends:
    msllm's CPU flash kernel, MindSpore's Ascend ``FlashAttentionScore``, or the composed
    operators (scores (B, H, T, T) -> mask -> softmax -> x V). The cached path is always composed.
    """

    def __init__(self, config: LlamaConfig, fast_paths: bool = False, choice: KernelChoice | None = None):
        super().__init__()
        c, h, k, d = config.hidden_size, config.num_heads, config.kv_heads, config.head_dim
        std = config.initializer_range
        kern = choice.cpu if choice is not None else None
        self.n_heads, self.n_kv, self.head_dim, self.n_rep, self.hidden = h, k, d, h // k, c
        self.q_proj = Linear(c, h * d, config, std, kern)
        self.k_proj = Linear(c, k * d, config, std, kern)
        self.v_proj = Linear(c, k * d, config, std, kern)
        self.o_proj = Linear(h * d, c, config, std, kern)
        attention = choice.attention if choice is not None else ""
        self.flash = None
        self.fa_score = None
        if attention == CPU_FLASH:
            # fused path: msllm/kernels/csrc/attention.cc (FlashAttention-2 blocking on the CPU; q, k,
            # v stay in the projections' (B, T, heads, D) layout; rotary by csrc/elementwise.cc)
            self.flash, self.rope = kern.flash_attention, kern.rope
        elif attention == ASCEND_FLASH:
            # fused path: MindSpore's FlashAttentionScore (Ascend; its docstring in mindspore 2.10
            # ops/auto_generate/gen_ops_prim.py): layout "BNSD" = (B, N, S, D), N2 = K kv heads
            # dividing N1 = H (GQA without repeat_kv), scale 1/sqrt(D), sparse_mode 2 =
            # "leftUpCausal" with the compressed (2048, 2048) uint8 mask, 1 = discard (above the
            # diagonal); output 3 is attention_out (B, H, T, D)
            self.fa_score = FlashAttentionScore(head_num=h, keep_prob=1.0, scale_value=1.0 / math.sqrt(d),
                                                pre_tokens=2147483647, next_tokens=2147483647,
                                                inner_precise=0, input_layout="BNSD", sparse_mode=2)
            self.fa_mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1), ms.uint8)
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
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()
        self.mul_scale = ops.Mul()
        self.add_mask = ops.Add()
        self.softmax = ops.Softmax(-1)
        self.flat_softmax = fast_paths
        self.kv_cache = KVCache()

    def rotate(self, x, cos, sin):
        """x (B, N, T, D); cos/sin (T, D) or per row (B, 1, T, D) -> (B, N, T, D)."""
        half = self.head_dim // 2
        x1 = x[..., :half]
        x2 = x[..., half:]
        rotated = self.concat((self.neg(x2), x1))                 # rotate_half(x)
        return self.add_rope(self.mul_cos(x, cos), self.mul_sin(rotated, sin))

    def repeat_kv(self, x):
        """(B, K, T, D) -> (B, H, T, D): each key/value head serves n_rep query heads."""
        if self.n_rep == 1:
            return x
        b, k, t, d = x.shape
        x = ops.broadcast_to(self.reshape(x, (b, k, 1, t, d)), (b, k, self.n_rep, t, d))
        return self.reshape(x, (b, k * self.n_rep, t, d))

    def project(self, x, cos, sin, scale_q=True):
        """x (B, T, C) -> q (B, H, T, D) rotated (and scaled by 1/sqrt(D) with ``scale_q``),
        k (B, K, T, D) rotated, v (B, K, T, D)."""
        b, t, c = x.shape
        x2d = self.reshape(x, (b * t, c))                                              # (B*T, C)
        q = self.transpose(self.reshape(self.q_proj(x2d), (b, t, self.n_heads, self.head_dim)), (0, 2, 1, 3))
        k = self.transpose(self.reshape(self.k_proj(x2d), (b, t, self.n_kv, self.head_dim)), (0, 2, 1, 3))
        v = self.transpose(self.reshape(self.v_proj(x2d), (b, t, self.n_kv, self.head_dim)), (0, 2, 1, 3))
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
        out = self.reshape(self.transpose(out, (0, 2, 1, 3)), (b * t, self.n_heads * self.head_dim))
        return self.reshape(self.o_proj(out), (b, t, self.hidden))                     # (B, T, C)

    def attend_flash(self, x, cos, sin):
        """msllm's CPU kernels: x (B, T, C) -> (B, T, C), causal, no transposes, no (B, H, T, T)."""
        b, t, c = x.shape
        x2d = self.reshape(x, (b * t, c))                                              # (B*T, C)
        q = self.rope(self.reshape(self.q_proj(x2d), (b, t, self.n_heads, self.head_dim)), cos, sin)
        k = self.rope(self.reshape(self.k_proj(x2d), (b, t, self.n_kv, self.head_dim)), cos, sin)
        v = self.reshape(self.v_proj(x2d), (b, t, self.n_kv, self.head_dim))          # (B, T, K, D)
        out, _ = self.flash(q, k, v)                                                   # (B, T, H, D)
        out = self.o_proj(self.reshape(out, (b * t, self.n_heads * self.head_dim)))    # (B*T, C)
        return self.reshape(out, (b, t, self.hidden))

    def attend_fa_score(self, x, cos, sin):
        """MindSpore's FlashAttentionScore (Ascend): x (B, T, C) -> (B, T, C), causal."""
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin, scale_q=False)                            # (B, H|K, T, D)
        _, _, _, out = self.fa_score(q, k, v, None, None, None, self.fa_mask, None)   # (B, H, T, D)
        out = self.reshape(self.transpose(out, (0, 2, 1, 3)), (b * t, self.n_heads * self.head_dim))
        return self.reshape(self.o_proj(out), (b, t, self.hidden))                     # (B, T, C)

    def construct(self, x, cos, sin, mask):
        if self.flash is not None:
            return self.attend_flash(x, cos, sin)
        if self.fa_score is not None:
            return self.attend_fa_score(x, cos, sin)
        q, k, v = self.project(x, cos, sin)
        return self.attend(q, k, v, mask)                                              # causal mask (T, T)

    def construct_cached(self, x, cos, sin, mask, k_cache, v_cache, write, fresh=False):
        """x (B, T, C); cos/sin (B, 1, T, D); mask (B, 1, T, S); caches (B, K, S, D); write (T, S)
        -> (out (B, T, C), k_cache, v_cache) with x's keys/values written to their slots.
        ``fresh`` (a compile-time constant): the caches are empty and x fills slots 0..T-1 (a
        prefill), so every later slot is masked and attending over x's own keys gives the same
        output at O(T^2), not O(T S) (with chat's whole-context buffer that was most of the first
        token's time: benchmarks/ttft_prefill.py)."""
        q, k, v = self.project(x, cos, sin)
        k_cache = self.kv_cache(k_cache, k, write, fresh)
        v_cache = self.kv_cache(v_cache, v, write, fresh)
        t, s = q.shape[2], k_cache.shape[2]
        if fresh and t < s:
            return self.attend(q, k, v, mask[:, :, :, :t]), k_cache, v_cache
        return self.attend(q, k_cache, v_cache, mask), k_cache, v_cache


class MLP(nn.Cell):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``; (N, C) -> (N, C)."""

    def __init__(self, config: LlamaConfig, kernels=None):
        super().__init__()
        c, f, std = config.hidden_size, config.ffn_size, config.initializer_range
        self.gate_proj = Linear(c, f, config, std, kernels)
        self.up_proj = Linear(c, f, config, std, kernels)
        self.down_proj = Linear(f, c, config, std, kernels)
        self.sigmoid = ops.Sigmoid()  # silu(g) = g * sigmoid(g); MindSpore 2.10 has no SiLU primitive
        self.mul_silu = ops.Mul()
        self.mul = ops.Mul()
        # fused path: msllm/kernels/csrc/elementwise.cc (silu(g) * u and its gradient in one pass)
        self.swiglu = kernels.swiglu if kernels is not None else None

    def construct(self, x):
        gate = self.gate_proj(x)                                                   # (N, F)
        if self.swiglu is not None:
            return self.down_proj(self.swiglu(gate, self.up_proj(x)))              # (N, C)
        act = self.mul_silu(gate, self.sigmoid(gate))
        return self.down_proj(self.mul(act, self.up_proj(x)))                      # (N, C)


class DecoderLayer(nn.Cell):
    """Pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h)); (B, T, C) -> (B, T, C)."""

    def __init__(self, config: LlamaConfig, fast_paths: bool = False, choice: KernelChoice | None = None):
        super().__init__()
        kern, norm = (choice.cpu, choice.norm) if choice is not None else (None, "")
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, config, fast_paths, norm, kern)
        self.self_attn = Attention(config, fast_paths, choice)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, config, fast_paths, norm, kern)
        self.mlp = MLP(config, kern)
        self.add_attn = ops.Add()
        self.add_mlp = ops.Add()
        self.reshape = ops.Reshape()

    def feed_forward(self, x, a):
        """x (B, T, C) and the attention output a (B, T, C) -> h + mlp(norm(h)) with h = x + a."""
        b, t, c = x.shape
        if self.post_attention_layernorm.fused_add is not None:  # residual add inside the norm kernel
            h, normed = self.post_attention_layernorm.add_and_norm(x, a)           # (B, T, C) each
        else:
            h = self.add_attn(x, a)
            normed = self.post_attention_layernorm(h)
        m = self.mlp(self.reshape(normed, (b * t, c)))                             # (B*T, C)
        return self.add_mlp(h, self.reshape(m, (b, t, c)))

    def construct(self, x, cos, sin, mask):
        return self.feed_forward(x, self.self_attn(self.input_layernorm(x), cos, sin, mask))

    def construct_cached(self, x, cos, sin, mask, k_cache, v_cache, write, fresh=False):
        """As ``construct`` for new tokens x (B, T, C) over a cache; returns (x', k_cache, v_cache)
        (``fresh``: :meth:`Attention.construct_cached`)."""
        a, k_cache, v_cache = self.self_attn.construct_cached(self.input_layernorm(x), cos, sin, mask,
                                                              k_cache, v_cache, write, fresh)
        return self.feed_forward(x, a), k_cache, v_cache


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
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         embedding_table=Normal(config.initializer_range),
                                         dtype=ms.int32)
        self.embed_tokens.embedding_table.set_dtype(ms_dtype(config.param_init_type))
        self.layers = nn.CellList([DecoderLayer(config, fast_paths, choice) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config, fast_paths, choice.norm, choice.cpu)
        cos, sin = rotary_tables(config)
        p = config.max_positions
        # Constant tables, not Parameters: they are not trained and not checkpointed.
        self.cos = Tensor(cos, ms_dtype(config.compute_dtype))                 # (P, D)
        self.sin = Tensor(sin, ms_dtype(config.compute_dtype))                 # (P, D)
        # Additive causal mask: 0 where key <= query, a large negative number above the diagonal
        # (-1e9 rather than -inf so fully masked rows cannot turn into NaN).
        self.mask = Tensor(np.triu(np.full((p, p), -1e9, np.float32), 1),
                           ms_dtype(config.softmax_compute_type))              # (P, P)
        self.compute_dtype = ms_dtype(config.compute_dtype)
        self.cast = ops.Cast()
        self.gather_pos = ops.Gather()
        self.reshape = ops.Reshape()

    def construct(self, input_ids):
        t = input_ids.shape[1]
        x = self.cast(self.embed_tokens(input_ids), self.compute_dtype)         # (B, T, C)
        cos, sin, mask = self.cos[:t], self.sin[:t], self.mask[:t, :t]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    def forward_cached(self, input_ids, positions, mask, write, caches, fresh=False):
        """New tokens over a cache -> (hidden (B, T, C), caches).

        input_ids / positions (B, T) int32 (each row's own positions, so left padding is
        invisible to the rotary embedding); mask (B, 1, T, S) additive float (0 = attend,
        -1e9 = not); write (T, S) float32 one-hot slots; caches: ``2 * num_layers`` tensors
        (B, K, S, D), keys then values per layer (:func:`~msllm.models.llama.kv_cache.empty_cache`);
        ``fresh``: the caches are empty and the T tokens go to slots 0..T-1 (a prefill; a
        compile-time constant, :meth:`Attention.construct_cached`).
        """
        b, t = input_ids.shape
        x = self.cast(self.embed_tokens(input_ids), self.compute_dtype)         # (B, T, C)
        d = self.cos.shape[-1]
        cos = self.reshape(self.gather_pos(self.cos, positions, 0), (b, 1, t, d))  # (B, 1, T, D)
        sin = self.reshape(self.gather_pos(self.sin, positions, 0), (b, 1, t, d))
        mask = self.cast(mask, self.mask.dtype)
        new_caches = ()
        i = 0
        for layer in self.layers:
            x, k_cache, v_cache = layer.construct_cached(x, cos, sin, mask, caches[2 * i], caches[2 * i + 1], write,
                                                         fresh)
            new_caches = new_caches + (k_cache, v_cache)
            i += 1
        return self.norm(x), new_caches


class LlamaForCausalLM(nn.Cell):
    """LLaMA with its output head and next-token loss.

    ``construct(input_ids, labels=None)``:
        input_ids (B, T+1) int32 with labels (B, T+1) int32 -> scalar fp32 mean cross-entropy over
            positions whose target (``labels[:, 1:]``) is not ``ignore_token_id``; tokens are
            ``input_ids[:, :-1]``. This is the MindRecord sample layout of ``llama_preprocess``.
        input_ids (B, T) alone -> logits (B, T, V) fp32.

    ``forward_cached(input_ids, positions, mask, write, caches, last_only)``: generation with a
    key/value cache (see :meth:`LlamaModel.forward_cached`) -> (logits (B, T, V) or with
    ``last_only`` (B, V) fp32, caches).

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
        self.config = config
        # which fused operators (msllm/kernels/select.py); device = RunConfig.context.device_target
        self.kernels = choose(config, fast_paths, device)
        log.info(self.kernels.describe())
        self.model = LlamaModel(config, fast_paths, self.kernels)
        self.compact_loss = fast_paths if compact_loss is None else compact_loss
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, config, config.initializer_range,
                                  self.kernels.cpu, dynamic_rows=self.compact_loss)
        if self.kernels.cpu is None:                     # for tied embeddings
            self.head_matmul = ops.MatMul(transpose_b=True)
        else:  # fused path: msllm/kernels/csrc/linear.cc
            kern = self.kernels.cpu
            self.head_matmul = kern.linear_dynamic_rows if self.compact_loss else kern.linear
        self.loss = CausalLMLoss(config.ignore_token_id, self.kernels.cpu)
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()
        self.gather_rows = ops.Gather()
        self.concat_rows = ops.Concat(0)
        # appended to the kept rows: row 0 with an ignored target, so that K = 0 (every target
        # ignored) still gives non-empty tensors (MindSpore's CPU Gather gradient fails on empty)
        self.extra_row = Tensor([0], ms.int64)
        self.extra_target = Tensor([config.ignore_token_id], ms.int32)

    def head(self, h):
        """h (N, C) -> logits (N, V) float32."""
        if self.lm_head is None:
            table = self.cast(self.model.embed_tokens.embedding_table, h.dtype)
            out = self.head_matmul(h, table)
        else:
            out = self.lm_head(h)
        return self.cast(out, ms.float32)

    def logits(self, tokens):
        """tokens (B, T) int32 -> logits (B, T, V) float32."""
        b, t = tokens.shape
        h = self.model(tokens)                                                  # (B, T, C)
        out = self.head(self.reshape(h, (b * t, self.config.hidden_size)))     # (B*T, V)
        return self.reshape(out, (b, t, self.config.vocab_size))

    def forward_cached(self, input_ids, positions, mask, write, caches, last_only=False, fresh=False):
        """Generation step over a key/value cache; shapes in :meth:`LlamaModel.forward_cached`.
        Returns (logits (B, T, V) float32, or (B, V) of the last position with ``last_only``,
        updated caches)."""
        h, caches = self.model.forward_cached(input_ids, positions, mask, write, caches, fresh)  # (B, T, C)
        b, t, c = h.shape
        if last_only:
            return self.head(self.reshape(h[:, t - 1:t, :], (b, c))), caches            # (B, V)
        return self.reshape(self.head(self.reshape(h, (b * t, c))), (b, t, self.config.vocab_size)), caches

    def construct(self, input_ids, labels=None):
        if labels is None:
            return self.logits(input_ids)
        tokens = input_ids[:, :-1]                                              # (B, T)
        targets = labels[:, 1:]                                                 # (B, T)
        if not self.compact_loss:
            return self.loss(self.logits(tokens), targets)
        h = self.reshape(self.model(tokens), (-1, self.config.hidden_size))    # (B*T, C)
        targets = self.reshape(targets, (-1,))                                  # (B*T,)
        keep = self.reshape(ops.nonzero(targets != self.config.ignore_token_id), (-1,))  # (K,)
        rows = self.concat_rows((keep, self.extra_row))                         # (K+1,)
        targets = self.concat_rows((self.gather_rows(targets, keep, 0), self.extra_target))
        return self.loss(self.head(self.gather_rows(h, rows, 0)), targets)    # (K+1, V) logits


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
