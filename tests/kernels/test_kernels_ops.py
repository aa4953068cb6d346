"""msllm's CPU kernels against independent references: forward outputs against numpy in float64,
gradients against MindSpore's automatic differentiation of the composed operators the kernels
replace (the model's fallback path).

Tolerance (float32 kernels): max |kernel - reference| <= 1e-5 * max |reference| (+ 1e-6 absolute
for values near zero) for forwards and gradients. The kernels sum in a different order than
the references (blocked GEMMs, per-thread partial sums), so results differ by rounding only:
observed 1e-7 to 2e-6 relative."""

import numpy as np
import pytest
from kerneltest_helpers import close, grads, seeded_rng

import mindspore as ms
from mindspore import Tensor, nn, ops

SEED = 20261122
RTOL = 1e-5


def rng():
    return seeded_rng(SEED)


def t(a):
    return Tensor(np.asarray(a, np.float32))


@pytest.mark.parametrize("x_shape,out", [((2, 5, 12), 7),      # leading dims, one thread (small)
                                         ((300, 96), 160),      # rows cut over the threads
                                         ((40, 64), 3000),      # columns cut (wide output)
                                         ((3, 37), 51),         # decoding's few rows: odd sizes, a tail
                                         ((1, 4, 576), 1537),   # decoding's weight-streaming path, threaded
                                         ((8, 203), 1001)],     # batch 8 streams too (gemv_max_rows), tails
                         ids=["small-3d", "row-slabs", "column-slabs", "gemv-odd", "gemv-threaded", "gemv-8"])
def test_linear_matches_matmul(kernels, pynative, x_shape, out):
    r = rng()
    x, w = r.standard_normal(x_shape), r.standard_normal((out, x_shape[-1])) * 0.1
    dy = r.standard_normal(x_shape[:-1] + (out,))
    close(kernels.linear(t(x), t(w)).asnumpy(), x @ w.T)
    got = grads(kernels.linear, (t(x), t(w)), t(dy))
    ref = grads(lambda a, b: ops.matmul(a, b.T), (t(x), t(w)), t(dy))
    for g, e in zip(got, ref):
        close(g, e)
    close(got[0], dy @ w)                                        # and against the formulas
    close(got[1], dy.reshape(-1, out).T @ x.reshape(-1, x_shape[-1]))


def test_linear_on_rows_known_only_at_run_time(kernels, graph_mode):
    """The output head under the compact loss: rows picked by nonzero(), so the GEMM's shape is
    dynamic in the compiled graph (``linear_dynamic_rows``: C++ shape inference in csrc/linear.cc)."""

    class Head(nn.Cell):
        def __init__(self, matmul, w):
            super().__init__()
            self.matmul = matmul
            self.w = ms.Parameter(Tensor(w), name="w")

        def construct(self, x, targets):
            keep = ops.nonzero(targets >= 0).reshape(-1)
            return (self.matmul(ops.gather(x, keep, 0), self.w) ** 2).sum()

    class Grad(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.g = ops.GradOperation(get_all=True, get_by_list=True)
            self.params = ms.ParameterTuple(net.trainable_params())

        def construct(self, x, targets):
            return self.net(x, targets), self.g(self.net, self.params)(x, targets)

    r = rng()
    x, w = r.standard_normal((50, 32)).astype(np.float32), (r.standard_normal((70, 32)) * 0.1).astype(np.float32)
    masks = [r.random(50) < 0.4, r.random(50) < 0.7]                 # two different row counts
    results = []
    for matmul in (kernels.linear_dynamic_rows, ops.MatMul(transpose_b=True)):
        net = Grad(Head(matmul, w))
        out = []
        for keep in masks:
            targets = np.where(keep, 1, -100).astype(np.int32)
            loss, (gx, gw) = net(Tensor(x), Tensor(targets))
            out.append((loss.asnumpy(), gx[0].asnumpy(), gw[0].asnumpy()))
        results.append(out)
    for mine, ref in zip(*results):
        for a, b in zip(mine, ref):
            close(a, b)


def visible(tq, window=0):
    """(T, T) bool: query q sees key k (k <= q, and q - W < k with a window W), written out by
    hand from transformers' sliding_window_overlay, not from msllm's mask."""
    allowed = np.zeros((tq, tq), bool)
    for qi in range(tq):
        for ki in range(tq):
            allowed[qi, ki] = ki <= qi and (window == 0 or ki > qi - window)
    return allowed


def attention_numpy(q, k, v, window=0):
    """Causal softmax(q k^T / sqrt(D)) v in float64; q (B,T,H,D), k/v (B,T,K,D), head h uses kv
    head h // (H/K); ``window`` W > 0: keys q-W+1..q only."""
    b, tq, h, d = q.shape
    rep = h // k.shape[2]
    kk, vv = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
    s = np.where(visible(tq, window), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    return np.einsum("bhqk,bkhd->bqhd", p, vv), lse


def attention_composed(q, k, v, window=0):
    """The same with MindSpore's operators (the model's fallback: scores, mask, softmax)."""
    b, tq, h, d = q.shape
    rep = h // k.shape[2]
    qq = ops.transpose(q, (0, 2, 1, 3))
    kk = ops.repeat_interleave(ops.transpose(k, (0, 2, 1, 3)), rep, 1)
    vv = ops.repeat_interleave(ops.transpose(v, (0, 2, 1, 3)), rep, 1)
    s = ops.matmul(qq, ops.transpose(kk, (0, 1, 3, 2))) / np.sqrt(d)
    s = s + Tensor(np.where(visible(tq, window), 0.0, -1e9).astype(np.float32))
    return ops.transpose(ops.matmul(ops.softmax(s, -1), vv), (0, 2, 1, 3))


@pytest.mark.parametrize("b,tq,h,kv,d", [(2, 70, 4, 2, 16),   # GQA, two query blocks (64 + 6)
                                         (1, 130, 2, 2, 8),   # three blocks, multi-head
                                         (3, 1, 2, 1, 8),     # one token
                                         (1, 800, 2, 1, 16),  # T >= 768: 128-row blocks, 7 of them
                                         (1, 200, 6, 2, 64),  # real models' head_dim 64 (SmolLM2, Qwen), GQA 3:1
                                         (1, 150, 4, 2, 128), # head_dim 128 (LLaMA, Mistral), GQA 2:1
                                         (1, 900, 4, 2, 64)], # T >= 768 with GQA and head_dim 64
                         ids=["gqa-2-blocks", "mha-3-blocks", "one-token", "mqa-128-row-blocks", "gqa-d64",
                              "gqa-d128", "gqa-d64-128-row-blocks"])
def test_flash_attention_matches_numpy_and_composed_gradients(kernels, pynative, b, tq, h, kv, d):
    check_flash(kernels, b, tq, h, kv, d, 0)


def check_flash(kernels, b, tq, h, kv, d, window):
    r = rng()
    q, k, v = (r.standard_normal((b, tq, n, d)) for n in (h, kv, kv))
    dy = r.standard_normal((b, tq, h, d))
    w = kernels.window_tensor(window)
    out, lse = kernels.flash_attention(t(q), t(k), t(v), w)
    ref, ref_lse = attention_numpy(q, k, v, window)
    close(out.asnumpy(), ref)
    close(lse.asnumpy(), ref_lse)
    got = grads(lambda *x: kernels.flash_attention(*x, w)[0], (t(q), t(k), t(v)), t(dy))
    want = grads(lambda *x: attention_composed(*x, window), (t(q), t(k), t(v)), t(dy))
    for g, e in zip(got, want):
        close(g, e)


@pytest.mark.parametrize("b,tq,h,kv,d,window", [(2, 70, 4, 2, 16, 5),     # window inside a 64-row block
                                                (1, 200, 2, 1, 16, 64),   # window = block rows
                                                (1, 130, 4, 4, 8, 100),   # window across 3 blocks
                                                (1, 800, 2, 1, 16, 300),  # 128-row blocks, window not a multiple
                                                (1, 50, 2, 2, 8, 1),      # each query sees itself only
                                                (1, 40, 2, 2, 8, 64)],    # window longer than T = causal
                         ids=["w5", "w64", "w100-3-blocks", "w300-128-row-blocks", "w1", "w-longer-than-t"])
def test_flash_attention_sliding_window(kernels, pynative, b, tq, h, kv, d, window):
    check_flash(kernels, b, tq, h, kv, d, window)


def test_flash_attention_is_causal(kernels, pynative):
    r = rng()
    q, k, v = (r.standard_normal((1, 100, 2, 16)) for _ in range(3))
    k2, v2 = k.copy(), v.copy()
    k2[:, 60:], v2[:, 60:] = r.standard_normal((1, 40, 2, 16)), r.standard_normal((1, 40, 2, 16))
    w = kernels.window_tensor(None)
    a = kernels.flash_attention(t(q), t(k), t(v), w)[0].asnumpy()
    c = kernels.flash_attention(t(q), t(k2), t(v2), w)[0].asnumpy()
    np.testing.assert_array_equal(a[:, :60], c[:, :60])
    assert np.abs(a[:, 60:] - c[:, 60:]).max() > 1e-2


def rms_numpy(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rms_composed(x, w):
    return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-5) * w


def test_rms_norm_and_residual_add(kernels, pynative):
    r = rng()
    x, a, w = r.standard_normal((3, 7, 40)), r.standard_normal((3, 7, 40)), 1 + 0.3 * r.standard_normal(40)
    dy, dh = r.standard_normal((3, 7, 40)), r.standard_normal((3, 7, 40))
    eps = kernels.eps_tensor(1e-5)
    y, rstd = kernels.rms_norm(t(x), t(w), eps)
    close(y.asnumpy(), rms_numpy(x, w, 1e-5))
    close(rstd.asnumpy(), 1 / np.sqrt((x * x).mean(-1).reshape(-1) + 1e-5))
    got = grads(lambda p, q: kernels.rms_norm(p, q, eps)[0], (t(x), t(w)), t(dy))
    for g, e in zip(got, grads(rms_composed, (t(x), t(w)), t(dy))):
        close(g, e)
    h, y2, _ = kernels.add_rms_norm(t(x), t(a), t(w), eps)
    close(h.asnumpy(), x + a)
    close(y2.asnumpy(), rms_numpy(x + a, w, 1e-5))

    def fused(p, q, s):  # both outputs used, as in the decoder block (residual + norm)
        hh, yy, _ = kernels.add_rms_norm(p, q, s, eps)
        return (hh * t(dh)).sum() + (yy * t(dy)).sum()

    def composed(p, q, s):
        hh = p + q
        return (hh * t(dh)).sum() + (rms_composed(hh, s) * t(dy)).sum()

    got = ops.grad(fused, grad_position=(0, 1, 2))(t(x), t(a), t(w))
    want = ops.grad(composed, grad_position=(0, 1, 2))(t(x), t(a), t(w))
    for g, e in zip(got, want):
        close(g.asnumpy(), e.asnumpy())


def test_swiglu(kernels, pynative):
    r = rng()
    g = r.standard_normal((33, 50)) * 4
    g[0, :4] = [-100.0, -30.0, 30.0, 100.0]                     # exp clamps: sigmoid saturates, no NaN
    u, dy = r.standard_normal((33, 50)), r.standard_normal((33, 50))
    close(kernels.swiglu(t(g), t(u)).asnumpy(), g / (1 + np.exp(-g)) * u)
    got = grads(kernels.swiglu, (t(g), t(u)), t(dy))
    want = grads(lambda a, b: a * ops.sigmoid(a) * b, (t(g), t(u)), t(dy))
    for x, e in zip(got, want):
        assert np.isfinite(x).all()
        close(x, e)


def test_rope(kernels, pynative):
    """General (not duplicated-half) tables, so every index of the formula is exercised; the
    tables have more rows (positions) than the sequence, as the model passes them."""
    r = rng()
    b, tq, n, d, p = 2, 9, 3, 8, 16
    x, dy = r.standard_normal((b, tq, n, d)), r.standard_normal((b, tq, n, d))
    cs, sn = r.standard_normal((p, d)), r.standard_normal((p, d))
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    c4, s4 = cs[None, :tq, None], sn[None, :tq, None]
    close(kernels.rope(t(x), t(cs), t(sn)).asnumpy(), x * c4 + np.concatenate([-x2, x1], -1) * s4)

    def composed(z):
        rot = ops.concat((-z[..., d // 2:], z[..., :d // 2]), -1)
        return z * t(c4) + rot * t(s4)

    close(grads(lambda z: kernels.rope(z, t(cs), t(sn)), (t(x),), t(dy))[0],
          grads(composed, (t(x),), t(dy))[0])


def test_kernels_refuse_other_dtypes(kernels, pynative):
    x = Tensor(np.ones((4, 8), np.float16))
    with pytest.raises(RuntimeError):
        kernels.swiglu(x, x).asnumpy()


def test_cross_entropy_rows(kernels, pynative):
    r = rng()
    n, v = 37, 1000
    z = r.standard_normal((n, v)) * 3
    y = r.integers(0, v, n).astype(np.int32)
    y[[3, 10, 11]] = -1                                          # ignored rows
    out = kernels.cross_entropy(t(z), Tensor(y)).asnumpy()
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = np.where(y >= 0, lse - z[np.arange(n), np.maximum(y, 0)], 0.0)
    close(out[:, 0], nll)
    close(out[:, 1], lse)
    g = r.standard_normal((n, 2))                                # gradient through both outputs

    def composed(logits):
        logp = ops.log_softmax(logits, -1)
        picked = ops.gather_elements(logp, 1, Tensor(np.maximum(y, 0)[:, None]))[:, 0]
        keep = Tensor((y >= 0).astype(np.float32))
        return ops.stack((-picked * keep, logits.logsumexp(-1)), -1)

    close(grads(lambda x: kernels.cross_entropy(x, Tensor(y)), (t(z),), t(g))[0],
          grads(composed, (t(z),), t(g))[0])


@pytest.mark.parametrize("sizes", [(3, 0, 5, 1), (200, 90, 0, 150)], ids=["small-with-empty", "threaded"])
def test_grouped_linear_is_one_matmul_per_group(kernels, pynative, sizes):
    """Rows sorted by expert, group g = rows offsets[g] .. offsets[g+1]-1 times w[g]^T; the
    gradients by the formulas dx_g = dy_g w_g, dw_g = dy_g^T x_g (zero for an empty group)."""
    r = rng()
    e, cin, cout = len(sizes), 24, 40
    m = sum(sizes)
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.float32)
    x, w, dy = r.standard_normal((m, cin)), r.standard_normal((e, cout, cin)) * 0.1, r.standard_normal((m, cout))
    want = np.concatenate([x[int(off[g]):int(off[g + 1])] @ w[g].T for g in range(e)])
    close(kernels.grouped_linear(t(x), t(w), t(off)).asnumpy(), want)
    dx, dw, doff = grads(kernels.grouped_linear, (t(x), t(w), t(off)), t(dy))
    close(dx, np.concatenate([dy[int(off[g]):int(off[g + 1])] @ w[g] for g in range(e)]))
    for g in range(e):
        rows = slice(int(off[g]), int(off[g + 1]))
        close(dw[g], dy[rows].T @ x[rows])
    assert not doff.any()


@pytest.mark.parametrize("b,h,kv,s,d", [(2, 6, 2, 37, 20), (3, 4, 4, 64, 64), (1, 9, 3, 5, 64), (2, 9, 3, 544, 64),
                                        (1, 8, 4, 100, 128), (2, 4, 2, 70, 256)],
                         ids=["gqa-odd", "mha", "smollm2-heads", "smollm2-544-slots", "head-dim-128", "head-dim-256"])
def test_decode_attention_is_masked_softmax_over_the_cache(kernels, pynative, b, h, kv, s, d):
    """One query per row over a flat (S * B, K, D) cache with an additive mask (padding before each row's
    first slot, nothing after its last): softmax(q k^T + mask) v with each key/value head serving
    H / K query heads, as repeat_kv + matmuls + softmax compute it (numpy, on (B, K, S, D))."""
    r = rng()
    q, k, v = r.standard_normal((b, h, 1, d)), r.standard_normal((b, kv, s, d)), r.standard_normal((b, kv, s, d))
    mask = np.zeros((b, 1, 1, s))
    for row in range(b):
        lo, hi = row % 3, s - 1 - row   # each row its own visible slots lo .. hi
        mask[row, 0, 0, :lo] = mask[row, 0, 0, hi + 1:] = -1e9
    slots_first = (2, 0, 1, 3)          # (B, K, S, D) -> the cache layout (S * B, K, D)
    cache = lambda x: t(np.ascontiguousarray(x.transpose(slots_first)).reshape(s * b, kv, d))  # noqa: E731
    got = kernels.decode_attention(t(q), cache(k), cache(v), t(mask)).asnumpy()
    kk, vv = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)          # (B, H, S, D)
    scores = q @ kk.transpose(0, 1, 3, 2) + mask                                      # (B, H, 1, S)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    close(got, (p / p.sum(-1, keepdims=True)) @ vv)


@pytest.mark.parametrize("b,h,kv,s,d", [(1, 9, 3, 544, 64), (8, 9, 3, 130, 64), (2, 32, 8, 100, 128), (1, 4, 2, 70, 256),
                                        (3, 6, 2, 33, 80)],
                         ids=["smollm2-b1", "smollm2-b8", "head-dim-128", "head-dim-256", "head-dim-80"])
def test_decode_attention_fixed_width_loops_give_the_generic_loops_bits(kernels, pynative, monkeypatch, b, h, kv, s, d):
    """One query per row: where the head dimension is a few whole vectors (64, 128; 256 with AVX-512) the
    kernel keeps a head's query and output in registers over the slots; its sums are the generic loops'
    term for term, so ``MSLLM_DECODE_ATTENTION=generic`` (the generic loops, read per call) gives the same
    bits, with hidden slots anywhere in the rows and (batch > 1) a row that sees nothing (output 0); both are checked
    against float64 by the test above. Head dimension 80 has no fixed-width loops: the two are one path."""
    r = rng()
    q = t(r.standard_normal((b, h, 1, d)))
    k, v = (t(r.standard_normal((s * b, kv, d))) for _ in range(2))
    mask = np.where(r.random((b, 1, 1, s)) < 0.3, -1e9, 0.0)
    if b > 1:
        mask[-1] = -1e9                                          # the last row sees nothing
    got = kernels.decode_attention(q, k, v, t(mask)).asnumpy()
    monkeypatch.setenv("MSLLM_DECODE_ATTENTION", "generic")
    generic = kernels.decode_attention(q, k, v, t(mask)).asnumpy()
    assert np.array_equal(got.view(np.uint32), generic.view(np.uint32))
    assert np.abs(got[0]).max() > 0.05 and (b == 1 or not got[-1].any())


@pytest.mark.parametrize("d", [64, 20], ids=["fixed-width", "generic"])
def test_decode_attention_in_a_cache_longer_than_its_tokens(kernels, pynative, d):
    """The serving engine's and chat's caches are longer than their rows' tokens: each row sees its own
    span of slots (left padding before, slots not written yet after; here rows of 1500 slots seeing
    [3, 200), [10, 700) with a hidden hole, and nothing at all), and the kernel visits only the span
    some row sees. Against the float64 masked softmax over the whole cache; the row that sees nothing
    gives 0."""
    r = rng()
    b, h, kv, s = 3, 6, 2, 1500
    q, k, v = r.standard_normal((b, h, 1, d)), r.standard_normal((b, kv, s, d)), r.standard_normal((b, kv, s, d))
    mask = np.full((b, 1, 1, s), -1e9)
    mask[0, 0, 0, 3:200] = 0.0
    mask[1, 0, 0, 10:700] = 0.0
    mask[1, 0, 0, 300:450] = -1e9
    slots_first = (2, 0, 1, 3)
    cache = lambda x: t(np.ascontiguousarray(x.transpose(slots_first)).reshape(s * b, kv, d))  # noqa: E731
    got = kernels.decode_attention(t(q), cache(k), cache(v), t(mask)).asnumpy()
    kk, vv = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)
    scores = q @ kk.transpose(0, 1, 3, 2) + mask
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vv
    want[2] = 0.0
    close(got, want)


def test_an_unknown_decode_attention_setting_is_refused_by_name(monkeypatch):
    from msllm.errors import MsllmError
    from msllm.kernels import library_path

    monkeypatch.setenv("MSLLM_DECODE_ATTENTION", "generc")
    with pytest.raises(MsllmError, match=r"MSLLM_DECODE_ATTENTION='generc': expected 'generic'"):
        library_path()
    monkeypatch.setenv("MSLLM_DECODE_ATTENTION", "generic")
    assert library_path().endswith(".so")


@pytest.mark.parametrize("b,h,kv,s,d,t_new,window", [(2, 6, 2, 70, 20, 5, 0), (1, 9, 3, 96, 64, 32, 0),
                                                     (2, 6, 2, 300, 32, 150, 40)],
                         ids=["gqa-odd", "smollm2-heads", "blocks-windowed"])
def test_decode_attention_of_several_queries_per_row(kernels, pynative, b, h, kv, s, d, t_new, window):
    """T new tokens per row over the cache (the serving engine's prefill pieces): each query has
    its own mask row (padding before the row's first slot, causal: query i of row b sees slots up
    to its own; with a sliding ``window`` on row 1 only the last ``window`` of them), the same
    float64 numpy reference as above with T queries; a query that sees nothing gives 0. T = 150
    spans three of the kernel's 64-query blocks, whose key ranges differ."""
    r = rng()
    q, k, v = r.standard_normal((b, h, t_new, d)), r.standard_normal((b, kv, s, d)), r.standard_normal((b, kv, s, d))
    mask = np.zeros((b, 1, t_new, s))
    for row in range(b):
        lo = 3 + row
        for i in range(t_new):
            last = s - t_new + i                      # query i sits in slot s - T + i
            mask[row, 0, i, :lo] = mask[row, 0, i, last + 1:] = -1e9
            if window and row == 1:
                mask[row, 0, i, :max(0, last + 1 - window)] = -1e9
    mask[0, 0, 0, :] = -1e9                           # a query that sees nothing
    slots_first = (2, 0, 1, 3)
    cache = lambda x: t(np.ascontiguousarray(x.transpose(slots_first)).reshape(s * b, kv, d))  # noqa: E731
    got = kernels.decode_attention(t(q), cache(k), cache(v), t(mask)).asnumpy()
    kk, vv = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)          # (B, H, S, D)
    scores = q @ kk.transpose(0, 1, 3, 2) + mask                                      # (B, H, T, S)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vv
    want[0, :, 0] = 0.0
    assert got.shape == (b, h, t_new, d)
    close(got, want)


def bf16_round(a):
    """float32 values rounded to bfloat16 by MindSpore (round to nearest even), widened back to
    float64: the values a bfloat16 tensor holds."""
    return Tensor(np.asarray(a, np.float32), ms.bfloat16).astype(ms.float32).asnumpy().astype(np.float64)


@pytest.mark.parametrize("m", [1, 5, 8, 9, 300], ids=["gemv-1", "gemv-5", "gemv-8", "slabs-9", "slabs-300"])
def test_linear_with_bfloat16_weights_is_float32_math_on_the_rounded_weights(kernels, pynative, m):
    """``param_init_type: bfloat16`` inference: the kernel widens each bf16 weight (exactly) and
    computes in float32, so its output is x times the rounded weights, to float32 rounding
    (streaming path up to 8 rows, widened slabs + sgemm beyond)."""
    r = rng()
    x, w = r.standard_normal((m, 200)), r.standard_normal((1001, 200)) * 0.1   # odd sizes: tails
    got = kernels.linear(t(x), Tensor(np.asarray(w, np.float32), ms.bfloat16)).asnumpy()
    assert got.dtype == np.float32
    close(got, np.asarray(x, np.float32).astype(np.float64) @ bf16_round(w).T)
    # and the rounding is what separates it from the float32 weights (the check above can fail)
    assert np.abs(got - x @ w.T).max() > 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedding_rows_from_a_float32_or_bfloat16_table(kernels, pynative, dtype):
    r = rng()
    table = r.standard_normal((50, 24)).astype(np.float32)
    ids = np.array([[3, 0, 49], [7, 7, 50]], np.int32)           # 50 is out of range: a zero row
    got = kernels.embedding(Tensor(table, getattr(ms, dtype)), Tensor(ids)).asnumpy()
    ref = table.astype(np.float64) if dtype == "float32" else bf16_round(table)
    want = np.concatenate([ref, np.zeros((1, 24))])[np.minimum(ids, 50)]
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("tq,window,starts", [(70, 0, [0, 5, 69]),     # one row fully padded but its last slot
                                              (130, 0, [64, 0, 100]),  # padding past a whole 64-row block
                                              (90, 7, [3, 40, 0])],    # sliding window and padding together
                         ids=["pads", "pad-a-block", "window"])
def test_flash_attention_padded_rows(kernels, pynative, tq, window, starts):
    """A prefill of left-padded rows: row b's query t sees keys max(start[b], t - W + 1) .. t (numpy,
    the additive mask the composed path uses), and the padding rows give exactly 0."""
    r = rng()
    b, h, kv, d = len(starts), 6, 2, 16
    q, k, v = (r.standard_normal((b, tq, n, d)) for n in (h, kv, kv))
    out = kernels.flash_attention_padded(t(q), t(k), t(v), kernels.window_tensor(window),
                                         t(np.array(starts, np.float32))).asnumpy()
    kk, vv = np.repeat(k, h // kv, axis=2), np.repeat(v, h // kv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
    key, query = np.arange(tq)[None, :], np.arange(tq)[:, None]
    for row, st in enumerate(starts):
        seen = (key <= query) & (key >= st) & ((key > query - window) if window else True)
        s[row] = np.where(seen, s[row], -np.inf)
        pad = slice(0, st)
        p = np.exp(s[row, :, st:] - s[row, :, st:].max(-1, keepdims=True))
        ref = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vv[row])
        close(out[row, st:], ref)
        np.testing.assert_array_equal(out[row, pad], 0.0)
