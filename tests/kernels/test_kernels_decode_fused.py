"""The fused decode step (msllm/kernels/csrc/decode_fused.cc): ``decode_front`` (RMSNorm, q / k / v
projections, rotary, the attention scale) and ``decode_back`` (decode attention, o projection,
residual add + RMSNorm, SwiGLU MLP, residual add), for float32, bfloat16 and int8 weights (int8 on
each instruction-set path this CPU can execute, ``MSLLM_INT8_ISA``), and a mix of them. The whole file
also runs against the library compiled as for an AVX2-only machine (``-march=haswell``: tests/kernels/test_kernels_avx2_build.py).

Two references: (1) numpy float64 of the layer's formulas (HF ``LlamaDecoderLayer`` with
``rotate_half`` rotary; weights as the kernel reads them: bfloat16 values widened, int8 dequantised
q * s), within the kernels' usual tolerance (1e-5 x max |reference| + 1e-6); (2) msllm's unfused
operators run one by one (``rms_norm``, ``linear`` / ``linear_int8``, ``rope``, ``decode_attention``,
``add_rms_norm``, ``swiglu``): the fused step runs the same C++ functions, so it must equal them
bit for bit (the model's decode logits depend on it: tests/models/test_llama_decode_fused.py).
"""

import os

import numpy as np
import pytest
from kerneltest_helpers import close

import mindspore as ms
from mindspore import Tensor, ops

from msllm.kernels.toolchain import cpu_flags
from msllm.models.llama.quantization import dequantize, quantize_rows

SEED = 20261128
EPS = 1e-5
C, H, K, D, F, S = 80, 4, 2, 16, 96, 24   # C = 80: a 16-lane tail in the norms; 2 query heads per kv head


def paths_on_this_cpu(none_name):
    """The kernels' instruction-set paths this CPU can execute, widest first, then the one without vector
    code (``none_name``). A path whose instructions the CPU lacks cannot be run here (no emulator): an AMD
    Zen 3 runs avx2 and the plain path, an AVX-512 machine all three. Printed by the tests that use it."""
    flags = cpu_flags()
    have = [isa for isa, need in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"})) if need <= flags]
    return have + [none_name]


@pytest.fixture
def isa_env():
    """Restores MSLLM_INT8_ISA and MSLLM_GEMV_ISA (the kernels read them per call) after the test."""
    old = {k: os.environ.get(k) for k in ("MSLLM_INT8_ISA", "MSLLM_GEMV_ISA")}
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class W:
    """One projection's weight as the kernels take it, and its float64 value."""

    def __init__(self, w: np.ndarray, kind: str, kernels, group: int = 0):
        self.kind = kind
        if kind == "int8":
            q, s, g = quantize_rows(w, group)
            self.args = (Tensor(q), Tensor(s), kernels.group_tensor(g))
            self.value = dequantize(q, s, g).astype(np.float64)
        else:
            t = Tensor(w, ms.bfloat16 if kind == "bf16" else ms.float32)
            self.args = (t,)
            self.value = t.astype(ms.float32).asnumpy().astype(np.float64)

    def unfused(self, kernels, x):
        if self.kind == "int8":
            return kernels.linear_int8(x, *self.args)
        return kernels.linear(x, self.args[0])


def layer(kernels, kinds, b, seed=0):
    r = np.random.default_rng(SEED + seed)
    kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds] * 7
    shapes = [(H * D, C), (K * D, C), (K * D, C), (C, H * D), (F, C), (F, C), (C, F)]
    groups = [0, 16, 0, 32, 0, 16, 32]
    ws = [W((r.standard_normal(s) / np.sqrt(s[1])).astype(np.float32), k, kernels, g)
          for s, k, g in zip(shapes, kinds, groups)]
    x = r.standard_normal((b, 1, C)).astype(np.float32)
    n1 = (1 + 0.2 * r.standard_normal(C)).astype(np.float32)
    n2 = (1 + 0.2 * r.standard_normal(C)).astype(np.float32)
    pos = r.integers(0, 200, b)
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    ang = pos[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], -1).astype(np.float32)
    cos, sin = np.cos(ang).reshape(b, 1, 1, D), np.sin(ang).reshape(b, 1, 1, D)
    kc = r.standard_normal((S * b, K, D)).astype(np.float32)
    vc = r.standard_normal((S * b, K, D)).astype(np.float32)
    mask = np.where(r.random((b, 1, 1, S)) < 0.3, -1e9, 0).astype(np.float32)
    mask[:, :, :, S - 1] = 0                                          # the new token's slot is visible
    return dict(ws=ws, x=x, n1=n1, n2=n2, cos=cos.astype(np.float32), sin=sin.astype(np.float32), kc=kc, vc=vc,
                mask=mask, b=b)


def rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def rot(x, cos, sin):   # x (..., D); HF rotate_half
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def reference(p):
    """float64: q (B, H, 1, D), k (1, B, K, D), v, out (B, 1, C) and the caches (S * B, K, D) with slot S-1 written."""
    b = p["b"]
    wq, wk, wv, wo, wg, wu, wd = (w.value for w in p["ws"])
    x = p["x"].astype(np.float64).reshape(b, C)
    cos, sin = p["cos"].reshape(b, 1, D).astype(np.float64), p["sin"].reshape(b, 1, D).astype(np.float64)
    y = rms(x, p["n1"])
    q = rot((y @ wq.T).reshape(b, H, D), cos, sin) / np.sqrt(D)
    k = rot((y @ wk.T).reshape(b, K, D), cos, sin)
    v = (y @ wv.T).reshape(b, K, D)
    kc = p["kc"].astype(np.float64).reshape(S, b, K, D).copy()
    vc = p["vc"].astype(np.float64).reshape(S, b, K, D).copy()
    kc[S - 1], vc[S - 1] = k, v
    attn = np.zeros((b, H, D))
    for bi in range(b):
        for hi in range(H):
            sc = kc[:, bi, hi // (H // K)] @ q[bi, hi] + p["mask"][bi, 0, 0]
            e = np.exp(sc - sc.max())
            attn[bi, hi] = (e / e.sum()) @ vc[:, bi, hi // (H // K)]
    h = x + attn.reshape(b, H * D) @ wo.T
    n = rms(h, p["n2"])
    g, u = n @ wg.T, n @ wu.T
    out = h + (g / (1 + np.exp(-g)) * u) @ wd.T
    return (q.reshape(b, H, 1, D), k.reshape(1, b, K, D), v.reshape(1, b, K, D), out.reshape(b, 1, C),
            kc.reshape(S * b, K, D), vc.reshape(S * b, K, D))


def fused(kernels, p, norm_dtype=ms.float32):
    b = p["b"]
    wq, wk, wv, wo, wg, wu, wd = p["ws"]
    eps = kernels.eps_tensor(EPS)
    scale = Tensor(np.array([1 / np.sqrt(D)], np.float32))
    front = kernels.decode_front(H, K, D)
    q, k, v = front(Tensor(p["x"]), Tensor(p["n1"], norm_dtype), eps, *wq.args, *wk.args, *wv.args,
                    Tensor(p["cos"]), Tensor(p["sin"]), scale)
    kc = p["kc"].reshape(S, b, K, D).copy()
    vc = p["vc"].reshape(S, b, K, D).copy()
    kc[S - 1], vc[S - 1] = k.asnumpy()[0], v.asnumpy()[0]              # the model's ScatterUpdate of slot S-1
    kc, vc = kc.reshape(S * b, K, D), vc.reshape(S * b, K, D)
    out = kernels.decode_back(Tensor(p["x"]), q, Tensor(kc), Tensor(vc), Tensor(p["mask"]), *wo.args,
                              Tensor(p["n2"], norm_dtype), eps, *wg.args, *wu.args, *wd.args)
    return q.asnumpy(), k.asnumpy(), v.asnumpy(), out.asnumpy(), kc, vc


def unfused(kernels, p):
    """The model's operator-by-operator decode step (Attention.decode_one + DecoderLayer.feed_forward)."""
    b = p["b"]
    wq, wk, wv, wo, wg, wu, wd = p["ws"]
    eps = kernels.eps_tensor(EPS)
    x = Tensor(p["x"])
    cos, sin = Tensor(p["cos"].reshape(b, D)), Tensor(p["sin"].reshape(b, D))
    y = kernels.rms_norm(x, Tensor(p["n1"]), eps)[0].reshape(b, C)
    q = kernels.rope(wq.unfused(kernels, y).reshape(1, b, H, D), cos, sin)
    k = kernels.rope(wk.unfused(kernels, y).reshape(1, b, K, D), cos, sin)
    v = wv.unfused(kernels, y).reshape(1, b, K, D)
    q = ops.mul(q.reshape(b, H, 1, D), 1 / np.sqrt(D))
    kc = p["kc"].reshape(S, b, K, D).copy()
    vc = p["vc"].reshape(S, b, K, D).copy()
    kc[S - 1], vc[S - 1] = k.asnumpy()[0], v.asnumpy()[0]
    kc, vc = kc.reshape(S * b, K, D), vc.reshape(S * b, K, D)
    attn = kernels.decode_attention(q, Tensor(kc), Tensor(vc), Tensor(p["mask"]))
    a = wo.unfused(kernels, attn.reshape(b, H * D)).reshape(b, 1, C)
    h, n, _ = kernels.add_rms_norm(x, a, Tensor(p["n2"]), eps)
    n = n.reshape(b, C)
    m = wd.unfused(kernels, kernels.swiglu(wg.unfused(kernels, n), wu.unfused(kernels, n)))
    out = ops.add(h, m.reshape(b, 1, C))
    return q.asnumpy(), k.asnumpy(), v.asnumpy(), out.asnumpy()


KINDS = ["f32", "bf16", "int8", ["int8", "f32", "bf16", "int8", "f32", "int8", "bf16"]]


@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("kinds", KINDS, ids=["f32", "bf16", "int8", "mixed"])
def test_fused_decode_step_is_the_float64_layer(kernels, pynative, kinds, b):
    print("seed", SEED)
    p = layer(kernels, kinds, b, seed=b)
    got = fused(kernels, p)
    want = reference(p)
    for g, w in zip(got, want):
        close(g, w)


@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("kinds", KINDS, ids=["f32", "bf16", "int8", "mixed"])
def test_fused_decode_step_equals_the_unfused_operators_bit_for_bit(kernels, pynative, kinds, b):
    p = layer(kernels, kinds, b, seed=10 + b)
    got = fused(kernels, p)
    want = unfused(kernels, p)
    for g, w in zip(got[:4], want):
        np.testing.assert_array_equal(g, w)


def test_fused_decode_takes_bfloat16_norm_weights(kernels, pynative):
    """A bfloat16 model's norm weights are widened inside the kernel (exact), as the model's Cast does."""
    p = layer(kernels, "bf16", 2, seed=30)
    p["n1"] = Tensor(p["n1"], ms.bfloat16).astype(ms.float32).asnumpy()
    p["n2"] = Tensor(p["n2"], ms.bfloat16).astype(ms.float32).asnumpy()
    want = fused(kernels, p)
    got = fused(kernels, p, norm_dtype=ms.bfloat16)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("isa", paths_on_this_cpu("scalar"))
@pytest.mark.parametrize("b", [1, 5])
def test_fused_decode_int8_on_each_instruction_set(kernels, pynative, isa_env, isa, b):
    print("int8 paths on this CPU:", paths_on_this_cpu("scalar"))
    os.environ["MSLLM_INT8_ISA"] = isa
    p = layer(kernels, "int8", b, seed=40 + b)
    got = fused(kernels, p)
    for g, w in zip(got, reference(p)):
        close(g, w)
    for g, w in zip(got[:4], unfused(kernels, p)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("isa", paths_on_this_cpu("none"))
@pytest.mark.parametrize("kinds,b", [("f32", 1), ("f32", 4), ("bf16", 1), ("bf16", 7)])
def test_fused_decode_float_weights_on_each_streaming_path(kernels, pynative, isa_env, isa, kinds, b):
    """The float32 / bfloat16 streaming product on AVX-512, on AVX2 (csrc/gemv_avx2.cc, the path of a
    CPU without AVX-512) and without streaming (oneDNN's sgemm; bfloat16 widened in slabs), chosen with
    MSLLM_GEMV_ISA: the float64 layer, and the unfused operators (which take the same path) bit for bit."""
    import ctypes as ct

    from msllm.kernels import library_path

    print("streaming paths on this CPU:", paths_on_this_cpu("none"))
    if isa == "avx512" and ct.CDLL(library_path()).msllm_vector_isa() != 2:
        pytest.fail("this library was built without AVX-512 (MSLLM_KERNELS_MARCH): build it with -march=native")
    os.environ["MSLLM_GEMV_ISA"] = isa
    assert ct.CDLL(library_path()).msllm_gemv_isa() == {"avx512": 2, "avx2": 1, "none": 0}[isa]
    p = layer(kernels, kinds, b, seed=70 + b)
    got = fused(kernels, p)
    for g, w in zip(got, reference(p)):
        close(g, w)
    for g, w in zip(got[:4], unfused(kernels, p)):
        np.testing.assert_array_equal(g, w)


def test_fused_decode_refuses_inconsistent_inputs(kernels, pynative):
    """A weight whose input width is not C, or an int8 group size that does not give its scales,
    makes the kernel return an error (MindSpore raises) instead of reading out of bounds."""
    p = layer(kernels, "f32", 1, seed=50)
    wq, wk, wv = p["ws"][:3]
    eps = kernels.eps_tensor(EPS)
    front = kernels.decode_front(H, K, D)
    bad = Tensor(np.zeros((H * D, C + 1), np.float32))
    with pytest.raises(RuntimeError):
        front(Tensor(p["x"]), Tensor(p["n1"]), eps, bad, *wk.args, *wv.args, Tensor(p["cos"]), Tensor(p["sin"]),
              Tensor(np.array([0.25], np.float32)))[0].asnumpy()
    q8 = W(np.ones((K * D, C), np.float32), "int8", kernels, 16)
    with pytest.raises(RuntimeError):
        front(Tensor(p["x"]), Tensor(p["n1"]), eps, *wq.args, q8.args[0], q8.args[1], kernels.group_tensor(32),
              *wv.args, Tensor(p["cos"]), Tensor(p["sin"]), Tensor(np.array([0.25], np.float32)))[0].asnumpy()


@pytest.mark.parametrize("b", [1, 3])
def test_fused_front_writes_the_new_keys_and_values_into_the_cache_rows(kernels, pynative, b):
    """With the caches and the rows (1, B) int32 as three more inputs, ``decode_front`` writes k and
    v into cache rows ``rows[0, b]`` in place (the model's ScatterUpdate of slot S - 1 before):
    the float64 reference's caches, every other row untouched; a row outside the caches is an
    error before anything is written."""
    p = layer(kernels, "f32", b, seed=70 + b)
    wq, wk, wv = p["ws"][:3]
    eps = kernels.eps_tensor(EPS)
    scale = Tensor(np.array([1 / np.sqrt(D)], np.float32))
    kc = ms.Parameter(Tensor(p["kc"]), name="kc", requires_grad=False)
    vc = ms.Parameter(Tensor(p["vc"]), name="vc", requires_grad=False)
    rows = Tensor(((S - 1) * b + np.arange(b, dtype=np.int32))[None])      # slot S - 1 of every row
    front = kernels.decode_front(H, K, D)
    args = (Tensor(p["x"]), Tensor(p["n1"]), eps, *wq.args, *wk.args, *wv.args, Tensor(p["cos"]),
            Tensor(p["sin"]), scale)
    q, k, v = (t.asnumpy() for t in front(*args, kc, vc, rows))
    want = reference(p)
    for got, w in zip((q, k, v, kc.asnumpy(), vc.asnumpy()), want[:3] + want[4:]):
        close(got, w)
    before = kc.asnumpy().copy()
    with pytest.raises(RuntimeError):
        front(*args, kc, vc, Tensor(np.array([[S * b] * b], np.int32)))[0].asnumpy()
    np.testing.assert_array_equal(kc.asnumpy(), before)


@pytest.mark.parametrize("b", [1, 3])
def test_decode_stack_is_two_fused_layers_bit_for_bit_and_the_float64_layers(kernels, pynative, b):
    """``decode_stack`` with two layers (mixed weight kinds; the second layer's input is the first's
    output, cos / sin / mask shared) equals the per-layer fused operators chained bit for bit and the
    float64 layers chained within the usual tolerance; it writes both layers' caches at rows
    ``rows[0, b]``; a row outside the caches is an error before anything is written."""
    p1 = layer(kernels, KINDS[3], b, seed=90 + b)
    p2 = layer(kernels, KINDS[3][::-1], b, seed=95 + b)
    for key in ("cos", "sin", "mask"):
        p2[key] = p1[key]
    eps = kernels.eps_tensor(EPS)
    scale = Tensor(np.array([1 / np.sqrt(D)], np.float32))
    rows = Tensor(((S - 1) * b + np.arange(b, dtype=np.int32))[None])      # slot S - 1 of every row
    caches = [ms.Parameter(Tensor(p[c]), name=f"{c}{i}", requires_grad=False)
              for i, p in enumerate((p1, p2)) for c in ("kc", "vc")]

    def inputs(p, kc, vc):
        wq, wk, wv, wo, wg, wu, wd = p["ws"]
        return (Tensor(p["n1"]), eps, *wq.args, *wk.args, *wv.args, kc, vc, *wo.args, Tensor(p["n2"]), eps,
                *wg.args, *wu.args, *wd.args)

    args = (Tensor(p1["x"]), Tensor(p1["cos"]), Tensor(p1["sin"]), scale, Tensor(p1["mask"]), rows,
            *inputs(p1, *caches[:2]), *inputs(p2, *caches[2:]))
    before = [c.asnumpy().copy() for c in caches]
    with pytest.raises(RuntimeError):
        bad = args[:5] + (Tensor(np.array([[S * b] * b], np.int32)),) + args[6:]
        kernels.decode_stack(*bad).asnumpy()
    for c, old in zip(caches, before):
        np.testing.assert_array_equal(c.asnumpy(), old)
    out = kernels.decode_stack(*args).asnumpy()
    # the per-layer fused operators, chained
    *_, out1, kc1, vc1 = fused(kernels, p1)
    *_, out2, kc2, vc2 = fused(kernels, dict(p2, x=out1))
    np.testing.assert_array_equal(out, out2)
    for c, want in zip(caches, (kc1, vc1, kc2, vc2)):
        np.testing.assert_array_equal(c.asnumpy(), want)
    # float64
    *_, r1, rk1, rv1 = reference(p1)
    *_, r2, rk2, rv2 = reference(dict(p2, x=r1))
    close(out, r2)
    for c, want in zip(caches, (rk1, rv1, rk2, rv2)):
        close(c.asnumpy(), want)


# ---- the whole library compiled as for an AVX2-only machine --------------------------------------
def numpy_args(w: W):
    """A weight's kernel inputs as numpy arrays (bfloat16 as its uint16 bits)."""
    if w.kind == "bf16":
        bits = w.value.astype(np.float32).view(np.uint32) >> 16      # exact: the values are bfloat16
        return [bits.astype(np.uint16)]
    return [a.asnumpy() for a in w.args]
