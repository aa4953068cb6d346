"""msllm's AdamW (msllm/training/adamw.py) against independent references: MindSpore's own
``nn.AdamWeightDecay`` (bit for bit, fused kernel and composed update), a float64 numpy reference of
the AdamWeightDecay rule from MindSpore's docstring for MindFormers' FP32StateAdamWeightDecay
(float16 parameters, float32 moments), and the branch-free skip (an exact no-op, also with inf/NaN
gradients). CPU, GRAPH_MODE (the mode the train step compiles in)."""

import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn

from msllm.training.adamw import AdamW

SEED = 20261127
B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1
LR = np.array([1e-2, 5e-3, 2e-3], np.float32)  # a per-step table, as the trainer passes
pytestmark = pytest.mark.usefixtures("graph_mode")  # tests/conftest.py


class Apply(nn.Cell):
    """``optimizer(grads[, skip])`` compiled as a graph."""

    def __init__(self, opt, with_skip):
        super().__init__(auto_prefix=False)
        self.opt, self.with_skip = opt, with_skip

    def construct(self, grads, skip):
        if self.with_skip:
            return self.opt(grads, skip)
        return self.opt(grads)


def make(cls, dtype, **kw):
    """(optimizer, params): a matrix with weight decay and a vector without, as build_optimizer groups them."""
    rng = np.random.default_rng(SEED)
    w = Parameter(Tensor(rng.standard_normal((6, 5)).astype(np.float32), dtype), name="w")
    b = Parameter(Tensor(rng.standard_normal(5).astype(np.float32), dtype), name="b")
    groups = [{"params": [w], "weight_decay": WD}, {"params": [b], "weight_decay": 0.0}]
    return cls(groups, learning_rate=Tensor(LR), beta1=B1, beta2=B2, eps=EPS, **kw), [w, b]


def grads_of(step, dtype=ms.float32):
    rng = np.random.default_rng(SEED + 1 + step)
    return (Tensor(rng.standard_normal((6, 5)).astype(np.float32), dtype),
            Tensor(rng.standard_normal(5).astype(np.float32), dtype))


def state(opt):
    """{name: value} of the parameters and every optimizer state (names without Apply's ``opt.``)."""
    return {p.name.removeprefix("opt."): p.asnumpy().copy() for p in opt.get_parameters()}


@pytest.mark.parametrize("fused", [True, False])
def test_equals_mindspore_adamweightdecay_bit_for_bit(fused):
    print(f"seed {SEED}")
    ref, _ = make(nn.AdamWeightDecay, ms.float32)
    got, _ = make(AdamW, ms.float32)
    ref.use_fused_opt = got.use_fused_opt = fused  # the fused kernel, or MindSpore's composed update
    run_ref, run_got = Apply(ref, False), Apply(got, True)
    for step in range(3):
        run_ref(grads_of(step), Tensor(False))
        run_got(grads_of(step), Tensor(False))
        a, b = state(ref), state(got)
        assert a.keys() == b.keys() and {"adam_m.w", "adam_v.b", "global_step"} <= a.keys()
        for name in a:
            np.testing.assert_array_equal(b[name], a[name], err_msg=f"step {step}: {name}")


@pytest.mark.parametrize("dtype,state_dtype", [(ms.float32, None), (ms.float16, ms.float32)])
def test_a_skipped_step_changes_nothing_even_with_inf_and_nan_gradients(dtype, state_dtype):
    opt, _ = make(AdamW, dtype, state_dtype=state_dtype)
    run = Apply(opt, True)
    run(grads_of(0, dtype), Tensor(False))            # non-zero moments first
    before = state(opt)
    bad = (Tensor(np.full((6, 5), np.inf, np.float32), dtype), Tensor(np.full(5, np.nan, np.float32), dtype))
    run(bad, Tensor(True))
    after = state(opt)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert int(after["global_step"][0]) == 1
    run(grads_of(1, dtype), Tensor(False))            # and the next clean step updates again
    assert not np.array_equal(state(opt)["w"], before["w"])


def test_fp32_state_adamw_with_fp16_parameters_follows_the_rule_in_float32():
    """MindFormers' FP32StateAdamWeightDecay: float32 moments for float16 parameters. Reference: the
    AdamWeightDecay rule (MindSpore nn.AdamWeightDecay docstring: m = b1 m + (1-b1) g,
    v = b2 v + (1-b2) g^2, p -= lr (m / (sqrt(v) + eps) + wd p)) in float64 from the same fp16
    start, with the parameter rounded to fp16 after each step as the optimizer stores it."""
    opt, (w, b) = make(AdamW, ms.float16, state_dtype=ms.float32)
    assert not opt.use_fused_opt
    assert [(m.name, m.dtype) for m in opt.moments1] == [("adam_m.w", ms.float32), ("adam_m.b", ms.float32)]
    assert [m.dtype for m in opt.moments2] == [ms.float32, ms.float32]
    assert w.dtype == ms.float16
    plain, _ = make(AdamW, ms.float16)                 # AdamW: moments in the parameters' dtype
    assert [m.dtype for m in plain.moments1] == [ms.float16, ms.float16]

    ref = {"w": w.asnumpy().astype(np.float64), "b": b.asnumpy().astype(np.float64)}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(x) for k, x in ref.items()}
    run = Apply(opt, True)
    for step in range(3):
        g16 = grads_of(step, ms.float16)
        run(g16, Tensor(False))
        for (name, wd), g in zip((("w", WD), ("b", 0.0)), g16):
            g = g.asnumpy().astype(np.float64)
            m[name] = B1 * m[name] + (1 - B1) * g
            v[name] = B2 * v[name] + (1 - B2) * g * g
            upd = m[name] / (np.sqrt(v[name]) + EPS) + wd * ref[name]
            ref[name] = (ref[name] - float(LR[step]) * upd).astype(np.float16).astype(np.float64)
    got = state(opt)
    for name in ("w", "b"):
        np.testing.assert_allclose(got[f"adam_m.{name}"], m[name], rtol=1e-5, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(got[f"adam_v.{name}"], v[name], rtol=1e-5, atol=1e-7, err_msg=name)
        # fp16 storage: at most one fp16 ulp from the reference's own fp16 rounding
        np.testing.assert_allclose(got[name].astype(np.float64), ref[name], rtol=1e-3, atol=1e-3, err_msg=name)
    assert got["adam_m.w"].dtype == np.float32 and got["w"].dtype == np.float16


def test_state_dtype_other_than_float32_is_refused():
    with pytest.raises(ValueError, match="state_dtype"):
        make(AdamW, ms.float32, state_dtype=ms.float16)


# ---- the one-pass CPU update (AdamW.cpu_update on csrc/optim.cc) ---------------------------------

needs_kernels = pytest.mark.skipif(not __import__("msllm.kernels", fromlist=["available"]).available(),
                                   reason="msllm's CPU kernels are not built (make install builds them)")
BIG = (301, 250)   # 75,250 elements: three of the kernel's 2^15-element tasks and a tail that is no lane multiple


class CpuApply(nn.Cell):
    """``optimizer.cpu_update(grads, skip, coef)`` compiled as a graph."""

    def __init__(self, opt):
        super().__init__(auto_prefix=False)
        self.opt = opt

    def construct(self, grads, skip, coef):
        return self.opt.cpu_update(grads, skip, coef)


def make_big(cls, **kw):
    rng = np.random.default_rng(SEED)
    w = Parameter(Tensor(rng.standard_normal(BIG).astype(np.float32)), name="w")
    b = Parameter(Tensor(rng.standard_normal(BIG[1]).astype(np.float32)), name="b")
    groups = [{"params": [w], "weight_decay": WD}, {"params": [b], "weight_decay": 0.0}]
    return cls(groups, learning_rate=Tensor(LR), beta1=B1, beta2=B2, eps=EPS, **kw)


def big_grads(step):
    rng = np.random.default_rng(SEED + 10 + step)
    return rng.standard_normal(BIG).astype(np.float32), rng.standard_normal(BIG[1]).astype(np.float32)


@needs_kernels
def test_cpu_update_equals_mindspore_adamweightdecay_on_the_scaled_gradients():
    """Three steps of the kernel's update with coef = 0.37 against MindSpore's own fused
    ``nn.AdamWeightDecay`` fed the gradients multiplied by 0.37 (the train step's unscale-and-clip
    multiply it replaces), and against the rule in float64: parameters and moments agree to float32
    rounding, the learning rate follows the per-step table, the step count moves."""
    from msllm.kernels import cpu_kernels

    print(f"seed {SEED}")
    coef = np.float32(0.37)
    ref = make_big(nn.AdamWeightDecay)
    got = make_big(AdamW, cpu_kernels=cpu_kernels())
    assert got.cpu_kernels is not None and got.cpu_update_note is None
    run_ref, run_got = Apply(ref, False), CpuApply(got)
    p64 = {"w": state(got)["w"].astype(np.float64), "b": state(got)["b"].astype(np.float64)}
    m64 = {k: np.zeros_like(v) for k, v in p64.items()}
    v64 = {k: np.zeros_like(v) for k, v in p64.items()}
    for step in range(3):
        gw, gb = big_grads(step)
        run_ref((Tensor(gw * coef), Tensor(gb * coef)), Tensor(False))
        run_got((Tensor(gw), Tensor(gb)), Tensor(False), Tensor(coef))
        for (name, wd), g in zip((("w", WD), ("b", 0.0)), (gw, gb)):
            g = (g * coef).astype(np.float64)
            m64[name] = B1 * m64[name] + (1 - B1) * g
            v64[name] = B2 * v64[name] + (1 - B2) * g * g
            p64[name] = p64[name] - float(LR[step]) * (m64[name] / (np.sqrt(v64[name]) + EPS) + wd * p64[name])
        a, b = state(ref), state(got)
        assert int(b["global_step"][0]) == step + 1
        for name in ("w", "b", "adam_m.w", "adam_m.b", "adam_v.w", "adam_v.b"):
            np.testing.assert_allclose(b[name], a[name], rtol=2e-6, atol=1e-7, err_msg=f"step {step}: {name}")
        for name in ("w", "b"):
            np.testing.assert_allclose(b[name], p64[name], rtol=1e-5, atol=1e-6, err_msg=f"step {step}: {name}")
            np.testing.assert_allclose(b[f"adam_v.{name}"], v64[name], rtol=1e-5, atol=1e-9)
    moved = np.abs(state(got)["w"] - make_big(AdamW).parameters[0].asnumpy()).max()
    assert moved > 1e-3   # lr 1e-2 .. 2e-3 moved the weights


@needs_kernels
def test_cpu_update_skips_exactly_even_with_inf_and_nan_gradients():
    from msllm.kernels import cpu_kernels

    opt = make_big(AdamW, cpu_kernels=cpu_kernels())
    run = CpuApply(opt)
    gw, gb = big_grads(0)
    run((Tensor(gw), Tensor(gb)), Tensor(False), Tensor(np.float32(1.0)))
    before = state(opt)
    bad = (Tensor(np.full(BIG, np.inf, np.float32)), Tensor(np.full(BIG[1], np.nan, np.float32)))
    run(bad, Tensor(True), Tensor(np.float32(1.0)))
    after = state(opt)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert int(after["global_step"][0]) == 1
    run((Tensor(gw), Tensor(gb)), Tensor(False), Tensor(np.float32(1.0)))
    assert not np.array_equal(state(opt)["w"], before["w"])


def test_cpu_update_is_declined_with_the_reason():
    """Without kernels, or for float16 parameters, MindSpore's update runs and the optimizer says why."""
    assert make_big(AdamW).cpu_update_note == "msllm's CPU kernels are off or not built"
    opt, _ = make(AdamW, ms.float16, state_dtype=ms.float32, cpu_kernels=object())
    assert opt.cpu_kernels is None and opt.cpu_update_note == "the parameters are not all float32"


@needs_kernels
def test_sum_squares_kernel_against_float64():
    """csrc/optim.cc's sum of squares: within float32 summation error of numpy's float64 sum, for
    sizes around its lanes and tasks; inf and NaN come through (the train step's overflow check)."""
    from msllm.kernels import cpu_kernels

    op = cpu_kernels().sum_squares
    rng = np.random.default_rng(SEED)
    for n in (1, 63, 64, 1000, 32768, 32769, 200_003):
        x = rng.standard_normal(n).astype(np.float32)
        got = float(op(Tensor(x)).asnumpy()[0])
        ref = float((x.astype(np.float64) ** 2).sum())
        assert abs(got - ref) <= 2e-6 * ref, (n, got, ref)
    x = rng.standard_normal((40, 1000)).astype(np.float32)
    x[7, 3] = np.inf
    assert np.isposinf(op(Tensor(x)).asnumpy()[0])
    x[9, 9] = np.nan
    assert np.isnan(op(Tensor(x)).asnumpy()[0])
