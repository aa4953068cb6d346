"""MindSpore's Ascend-only fused primitives, wired by construction: they cannot run on this CPU, so
numpy implementations of their DOCUMENTED semantics stand in for them, and the model built with
them must compute what msllm's composed operators compute.

Sources (mindspore 2.10 wheel, the primitives' docstrings):
* ``FlashAttentionScore`` (``mindspore/ops/auto_generate/gen_ops_prim.py``): attention_out =
  Softmax(Mask(scale_value * query key^T, attn_mask)) value; attn_mask uint8, 1 = discard;
  sparse_mode 0 = the full mask as given, 2 = "leftUpCausal" (query i keeps keys j <= i) and
  3 = "rightDownCausal" (j <= i + S2 - S1), both with the compressed (2048, 2048) mask; 4 = "band"
  (keys from pre_tokens before the query to next_tokens after it: i - pre_tokens <= j <= i + next_tokens,
  the same compressed mask);
  input_layout "BNSD" = (B, N, S, D) or "BSH" = (B, S, N*D); N2 key/value heads dividing N1;
  D a multiple of 16; query/key/value float16 or bfloat16; outputs (softmax_max, softmax_sum,
  softmax_out, attention_out). Which query head a key/value head serves is not spelled out; the
  reference uses the grouping of msllm's ``repeat_kv`` and HF ``repeat_kv`` (query head n uses
  key/value head n // (N1 / N2)), as MindFormers' LLaMA does.
* ``RmsNorm(epsilon)`` (same file; ``ops.rms_norm``): y = x / sqrt(mean(x^2) + epsilon) * gamma,
  gamma of x's dtype; second output rstd (float32) with x's shape, last axis 1.
"""

import dataclasses
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor
from mindspore.ops._utils.arg_handler import str_to_enum

from msllm.errors import MsllmError
from msllm.kernels import select
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.model import Attention, LlamaForCausalLM

SEED = 1122
LAYOUTS = {str_to_enum("FlashAttentionScore", "input_layout", name): name for name in ("BSH", "BNSD")}


def flash_attention_score(q, k, v, attn_mask, head_num, scale_value, input_layout, sparse_mode,
                          pre_tokens=2147483647, next_tokens=2147483647):
    """FlashAttentionScore's documented output ``attention_out`` in float64 (layouts BSH/BNSD,
    sparse modes 0, 2, 3, 4, no dropout, no real_shift)."""
    if input_layout == "BSH":
        b, s1, h1 = q.shape
        q = q.reshape(b, s1, head_num, -1).transpose(0, 2, 1, 3)
        d = q.shape[-1]
        k = k.reshape(b, k.shape[1], -1, d).transpose(0, 2, 1, 3)
        v = v.reshape(b, v.shape[1], -1, d).transpose(0, 2, 1, 3)
    b, n1, s1, d = q.shape
    n2, s2 = k.shape[1], k.shape[2]
    assert n1 == head_num and n1 % n2 == 0 and d % 16 == 0, "outside FlashAttentionScore's documented range"
    rep = n1 // n2
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = scale_value * np.einsum("bnqd,bnkd->bnqk", q.astype(np.float64), k.astype(np.float64))
    i, j = np.arange(s1)[:, None], np.arange(s2)[None, :]
    if sparse_mode == 0:
        discard = np.broadcast_to(attn_mask.astype(bool), (b, n1, s1, s2))
        discard = discard | (j < i - pre_tokens) | (j > i + next_tokens)
    elif sparse_mode in (2, 3):
        np.testing.assert_array_equal(attn_mask, np.triu(np.ones((2048, 2048), np.uint8), 1),
                                      err_msg="modes 2/3 take the compressed (2048, 2048) causal mask")
        discard = j > i if sparse_mode == 2 else j > i + (s2 - s1)
    elif sparse_mode == 4:
        np.testing.assert_array_equal(attn_mask, np.triu(np.ones((2048, 2048), np.uint8), 1),
                                      err_msg="mode 4 takes the compressed (2048, 2048) mask")
        discard = (j < i - pre_tokens) | (j > i + next_tokens)
    else:
        raise AssertionError(f"sparse_mode {sparse_mode} is not modelled here")
    scores = np.where(discard, -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = np.einsum("bnqk,bnkd->bnqd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    if input_layout == "BSH":
        out = out.transpose(0, 2, 1, 3).reshape(b, s1, n1 * d)
    return out


class FlashAttentionScoreStandIn:
    """Replaces a ``FlashAttentionScore`` primitive inside the model (PYNATIVE), taking every
    setting from the primitive the model built."""

    def __init__(self, prim):
        self.prim, self.calls = prim, 0
        self.no_mask = False  # negative control: attend to every key (sparse_mode 0, all-zero mask)

    def __call__(self, query, key, value, real_shift=None, drop_mask=None, padding_mask=None, attn_mask=None,
                 prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
        p = self.prim
        assert query.dtype in (ms.float16, ms.bfloat16), "FlashAttentionScore takes float16/bfloat16"
        assert real_shift is None and drop_mask is None and p.keep_prob == 1.0 and attn_mask.dtype == ms.uint8
        mask, mode = attn_mask.asnumpy(), p.sparse_mode
        if self.no_mask:
            mask, mode = np.zeros((query.shape[2], key.shape[2]), np.uint8), 0
        out = flash_attention_score(query.asnumpy(), key.asnumpy(), value.asnumpy(), mask, p.head_num,
                                    p.scale_value, LAYOUTS[p.input_layout], mode, p.pre_tokens, p.next_tokens)
        self.calls += 1
        dummy = Tensor(np.zeros(1, np.float32))
        return dummy, dummy, dummy, Tensor(out.astype(np.float32), query.dtype)


class RmsNormStandIn:
    """Replaces ``ops.RmsNorm(epsilon)`` by its documented formula."""

    def __init__(self, prim):
        self.eps, self.calls = prim.epsilon, 0

    def __call__(self, x, gamma):
        assert gamma.dtype == x.dtype, "RmsNorm: gamma has x's dtype"
        xv = x.asnumpy().astype(np.float64)
        rstd = 1.0 / np.sqrt((xv * xv).mean(-1, keepdims=True) + self.eps)
        self.calls += 1
        return Tensor((xv * rstd * gamma.asnumpy()).astype(np.float32), x.dtype), Tensor(rstd.astype(np.float32))


def small(**kw):
    base = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=96,
                seq_length=24, initializer_range=0.3, rope_theta=500000.0)
    base.update(kw)
    return LlamaConfig(**base)


def with_keys(cfg, **keys):
    """``cfg`` with the kernel-selection fields set (LlamaConfig fields)."""
    return dataclasses.replace(cfg, **keys)


@pytest.mark.parametrize("sparse_mode", [2, 0])
def test_documented_flash_attention_equals_msllm_composed_attention(pynative, sparse_mode):
    """Same q, k, v and the same causal mask: FlashAttentionScore's semantics (numpy, float64) and
    msllm's composed ``Attention.attend`` (float32, additive -1e9 mask, GQA by repeat_kv)."""
    print("seed", SEED)
    r = np.random.default_rng(SEED)
    b, n1, n2, s, d = 2, 4, 2, 24, 16
    q, k, v = r.standard_normal((b, n1, s, d)), r.standard_normal((b, n2, s, d)), r.standard_normal((b, n2, s, d))
    if sparse_mode == 2:
        mask = np.triu(np.ones((2048, 2048), np.uint8), 1)
    else:
        mask = np.triu(np.ones((s, s), np.uint8), 1)
    ref = flash_attention_score(q, k, v, mask, n1, 1 / np.sqrt(d), "BNSD", sparse_mode)   # (B, N1, S, D)
    attn = Attention(small())
    attn.o_proj.weight.set_data(Tensor(np.eye(n1 * d, dtype=np.float32)))   # expose attend's (B, T, H*D)
    additive = Tensor(np.triu(np.full((s, s), -1e9, np.float32), 1))
    got = attn.attend(Tensor((q / np.sqrt(d)).astype(np.float32)), Tensor(k.astype(np.float32)),
                      Tensor(v.astype(np.float32)), additive).asnumpy()
    ref = ref.transpose(0, 2, 1, 3).reshape(b, s, n1 * d)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    # BSH layout of the same numbers gives the same result (the reference is layout-consistent)
    bsh = flash_attention_score(*(x.transpose(0, 2, 1, 3).reshape(b, s, -1) for x in (q, k, v)), mask, n1,
                                1 / np.sqrt(d), "BSH", sparse_mode)
    np.testing.assert_allclose(bsh, ref, rtol=1e-12, atol=1e-12)


def test_model_builds_flash_attention_score_as_documented_and_computes_the_same_logits(pynative):
    print("seed", SEED)
    ms.set_seed(SEED)
    cfg = with_keys(small(compute_dtype="float16"), use_flash_attention=True, fused_rms_norm=False)
    fa = LlamaForCausalLM(cfg, fast_paths=False)
    assert fa.kernels.attention == select.ASCEND_FLASH
    composed = LlamaForCausalLM(with_keys(small(compute_dtype="float16"), use_flash_attention=False,
                                          fused_rms_norm=False), fast_paths=False)
    ms.load_param_into_net(composed, {p.name: p for p in fa.trainable_params()})
    stand_ins = []
    for layer in fa.model.layers:
        p = layer.self_attn.fa_score
        assert (p.head_num, p.keep_prob, p.scale_value, p.sparse_mode) == (4, 1.0, 0.25, 2)
        assert LAYOUTS[p.input_layout] == "BNSD"
        np.testing.assert_array_equal(layer.self_attn.fa_mask.asnumpy(), np.triu(np.ones((2048, 2048), np.uint8), 1))
        layer.self_attn.fa_score = FlashAttentionScoreStandIn(p)
        stand_ins.append(layer.self_attn.fa_score)
    ids = Tensor(np.random.default_rng(SEED).integers(3, 97, (2, 20)).astype(np.int32))
    got = fa(ids).asnumpy()
    want = composed(ids).asnumpy()
    assert all(s.calls == 1 for s in stand_ins)
    err = np.abs(got - want).max()
    # float16 activations: both paths round q, k, v and the outputs to float16
    assert err <= 2e-2 * np.abs(want).max(), err
    # a wiring mistake would show far above that: e.g. the attention without its causal mask
    for s in stand_ins:
        s.no_mask = True
    wrong = fa(ids).asnumpy()
    print("max |logit diff| vs composed", err, "| without the causal mask", np.abs(wrong - want).max(),
          "| max |logit|", np.abs(want).max())
    assert np.abs(wrong - want).max() > 10 * err


def test_model_builds_rms_norm_as_documented_and_computes_the_same_logits(pynative):
    ms.set_seed(SEED)
    cfg = with_keys(small(), use_flash_attention=False, fused_rms_norm=True)
    fused = LlamaForCausalLM(cfg, fast_paths=False)
    assert fused.kernels.norm == select.ASCEND_NORM
    composed = LlamaForCausalLM(with_keys(small(), use_flash_attention=False, fused_rms_norm=False),
                                fast_paths=False)
    r = np.random.default_rng(SEED)
    for p in fused.trainable_params():
        if p.name.endswith("layernorm.weight") or p.name == "model.norm.weight":
            p.set_data(Tensor((1 + 0.2 * r.standard_normal(p.shape)).astype(np.float32)))
    ms.load_param_into_net(composed, {p.name: p for p in fused.trainable_params()})
    norms = [fused.model.norm] + [n for layer in fused.model.layers
                                  for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    for n in norms:
        assert n.ascend_norm.epsilon == cfg.rms_norm_eps
        n.ascend_norm = RmsNormStandIn(n.ascend_norm)
    ids = Tensor(r.integers(3, 97, (2, 11)).astype(np.int32))
    got, want = fused(ids).asnumpy(), composed(ids).asnumpy()
    assert all(n.ascend_norm.calls == 1 for n in norms)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_selection_rules_on_the_layout_path():
    cpu, ascend = "CPU", "Ascend"
    fp16 = small(compute_dtype="float16")
    assert select.choose(small(), False, ascend).attention == select.COMPOSED        # float32: no FA
    assert select.choose(fp16, False, ascend).attention == select.ASCEND_FLASH       # default on Ascend
    assert select.choose(fp16, False, ascend).norm == select.ASCEND_NORM
    assert select.choose(fp16, False, cpu).attention == select.COMPOSED              # default on CPU
    assert select.choose(with_keys(small(compute_dtype="float16"), use_flash_attention=False), False,
                         ascend).attention == select.COMPOSED
    with pytest.raises(MsllmError, match="use_flash_attention.*float16 or bfloat16"):
        select.choose(with_keys(small(), use_flash_attention=True), False, ascend)
    with pytest.raises(MsllmError, match="multiple of 16"):
        select.choose(with_keys(small(hidden_size=32, compute_dtype="float16"), use_flash_attention=True),
                      False, ascend)
    note = select.choose(with_keys(small(compute_dtype="float16"), use_flash_attention=True), False, cpu)
    assert note.attention == select.ASCEND_FLASH and "Ascend only" in note.describe()


def test_layout_shards_the_fused_primitives_like_mindformers(pynative):
    """apply_layout on the model built with FlashAttentionScore and RmsNorm: q, k, v split
    (dp, mp, 1, 1) with the compressed mask replicated (MindFormers 1.9.0
    ``modules/flash_attention.py``, ``_generate_flash_attention_strategy``, sparse_mode 2), the
    norms (dp, 1, 1) with gamma replicated (``models/llama/llama_layer.py``, LlamaRMSNorm.shard);
    the composed attention's primitives get no rule."""
    from msllm.config import ParallelLayoutConfig
    from msllm.parallel.apply import apply_layout

    cfg = with_keys(small(compute_dtype="float16", num_layers=2), use_flash_attention=True, fused_rms_norm=True)
    net = LlamaForCausalLM(cfg, fast_paths=False)
    pc = ParallelLayoutConfig(data_parallel=2, model_parallel=2)
    rules = {r.name for r in apply_layout(net, pc)}
    attn = net.model.layers[1].self_attn
    assert attn.fa_score.in_strategy == ((2, 2, 1, 1), (2, 2, 1, 1), (2, 2, 1, 1), (1, 1))
    assert "model.layers.1.self_attn.fa_score" in rules and "model.layers.1.self_attn.softmax" not in rules
    assert net.model.layers[0].post_attention_layernorm.ascend_norm.in_strategy == ((2, 1, 1), (1,))
    assert net.model.norm.ascend_norm.in_strategy == ((2, 1, 1), (1,))
    # the composed model keeps the composed rules
    plain = LlamaForCausalLM(with_keys(small(), use_flash_attention=False, fused_rms_norm=False), fast_paths=False)
    names = {r.name for r in apply_layout(plain, pc)}
    assert "model.layers.1.self_attn.softmax" in names and "model.layers.1.self_attn.fa_score" not in names
    assert plain.model.layers[1].self_attn.softmax.in_strategy == ((2, 2, 1, 1),)


def test_sliding_window_builds_the_band_mode_and_computes_the_same_logits(pynative):
    """Mistral's window on the layout path: FlashAttentionScore in sparse_mode 4 with pre_tokens
    W - 1 and next_tokens 0 (documented band) computes what the composed attention with the
    windowed causal mask computes; the plain causal mode (2) would not."""
    ms.set_seed(SEED)
    window = 5
    cfg = with_keys(small(compute_dtype="float16", sliding_window=window), use_flash_attention=True,
                    fused_rms_norm=False)
    fa = LlamaForCausalLM(cfg, fast_paths=False)
    composed = LlamaForCausalLM(with_keys(small(compute_dtype="float16", sliding_window=window),
                                          use_flash_attention=False, fused_rms_norm=False), fast_paths=False)
    ms.load_param_into_net(composed, {p.name: p for p in fa.trainable_params()})
    stand_ins = []
    for layer in fa.model.layers:
        p = layer.self_attn.fa_score
        assert (p.sparse_mode, p.pre_tokens, p.next_tokens) == (4, window - 1, 0)
        layer.self_attn.fa_score = FlashAttentionScoreStandIn(p)
        stand_ins.append(layer.self_attn.fa_score)
    ids = Tensor(np.random.default_rng(SEED).integers(3, 97, (2, 20)).astype(np.int32))
    got, want = fa(ids).asnumpy(), composed(ids).asnumpy()
    err = np.abs(got - want).max()
    assert all(s.calls == 1 for s in stand_ins) and err <= 2e-2 * np.abs(want).max(), err
    # negative control: the same weights without the window (plain causal attention) are far off
    causal = LlamaForCausalLM(with_keys(small(compute_dtype="float16"), use_flash_attention=False,
                                        fused_rms_norm=False), fast_paths=False)
    ms.load_param_into_net(causal, {p.name: p for p in fa.trainable_params()})
    assert np.abs(causal(ids).asnumpy() - want).max() > 10 * err


def test_rms_norm_offset_reaches_the_fused_norm(pynative):
    """Gemma's (1 + w) norms on the layout path's RmsNorm: gamma = 1 + w, the composed result."""
    ms.set_seed(SEED)
    gemma = dict(rms_norm_offset=1.0, hidden_act="gelu_pytorch_tanh", embedding_multiplier=8.0)
    fused = LlamaForCausalLM(with_keys(small(**gemma), use_flash_attention=False, fused_rms_norm=True),
                             fast_paths=False)
    composed = LlamaForCausalLM(with_keys(small(**gemma), use_flash_attention=False, fused_rms_norm=False),
                                fast_paths=False)
    r = np.random.default_rng(SEED)
    for p in fused.trainable_params():
        if p.name.endswith("layernorm.weight") or p.name == "model.norm.weight":
            p.set_data(Tensor((0.2 * r.standard_normal(p.shape)).astype(np.float32)))
    ms.load_param_into_net(composed, {p.name: p for p in fused.trainable_params()})
    norms = [fused.model.norm] + [n for layer in fused.model.layers
                                  for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    for n in norms:
        n.ascend_norm = RmsNormStandIn(n.ascend_norm)
    ids = Tensor(r.integers(3, 97, (2, 11)).astype(np.int32))
    got, want = fused(ids).asnumpy(), composed(ids).asnumpy()
    assert all(n.ascend_norm.calls == 1 for n in norms)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
