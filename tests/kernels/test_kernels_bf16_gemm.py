"""``compute_dtype: bfloat16`` on the CPU kernels (csrc/gemm_bf16.cc): the linear layer and both of
its gradients are GEMMs whose two inputs are rounded to bfloat16 (round to nearest even) and whose
products are summed in float32.

Reference: numpy in float64 over inputs rounded by PyTorch's float32 -> bfloat16 conversion (round
to nearest even; independent of MindSpore and of msllm's C++). A product of two bfloat16 values is
exact in float32, so the kernel differs from the reference by float32 summation only: bound
``2e-6 * sum |products|`` per element (observed ~1e-7). Each case runs on both paths: oneDNN's
bfloat16 arithmetic where this CPU has it (AMX-BF16 / AVX512_BF16) and msllm's emulation
(``MSLLM_GEMM_BF16=emulate``: rounded copies, float32 sgemm), which must agree on every CPU.
The same inputs through the float32 kernel differ from the reference by far more than the bound,
so the checks can fail.
"""

import numpy as np
import pytest
from kerneltest_helpers import grads, seeded_rng

from mindspore import Tensor, nn, ops

SEED = 20261128
BOUND = 2e-6


def bf16(a) -> np.ndarray:
    """float32 values rounded to bfloat16 by PyTorch, as float64."""
    import torch

    return torch.from_numpy(np.asarray(a, np.float32)).bfloat16().double().numpy()


def check(got, a, b):
    """|got - a b| <= BOUND * (|a| |b|) elementwise, a and b already rounded (float64)."""
    want, scale = a @ b, np.abs(a) @ np.abs(b)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert (err <= BOUND * scale + 1e-30).all(), f"max relative error {(err / (scale + 1e-30)).max():.2e}"


@pytest.fixture(params=["native", "emulated"])
def gemm_path(request, monkeypatch):
    from msllm.kernels import gemm_bf16_native

    if request.param == "emulated":
        monkeypatch.setenv("MSLLM_GEMM_BF16", "emulate")
    else:
        monkeypatch.delenv("MSLLM_GEMM_BF16", raising=False)
        print("this CPU's bf16 arithmetic via oneDNN:", gemm_bf16_native())
    return request.param


@pytest.fixture(scope="module")
def bf16_kernels():
    from msllm.kernels import build, cpu_kernels

    build.build(verbose=False)
    return cpu_kernels("bfloat16")


@pytest.mark.parametrize("x_shape,out", [((2, 5, 12), 7),        # leading dims, tiny
                                         ((300, 576), 192),       # a k/v projection's shape
                                         ((1, 37), 51),           # one row: no streaming path here
                                         ((257, 130), 1031)],     # odd sizes everywhere
                         ids=["small-3d", "kv-proj", "one-row", "odd"])
def test_linear_and_gradients_are_float32_sums_of_bf16_products(bf16_kernels, pynative, gemm_path, x_shape, out):
    r = seeded_rng(SEED)
    x = r.standard_normal(x_shape).astype(np.float32)
    w = (r.standard_normal((out, x_shape[-1])) * 0.1).astype(np.float32)
    dy = r.standard_normal(x_shape[:-1] + (out,)).astype(np.float32)
    x2, dy2 = x.reshape(-1, x_shape[-1]), dy.reshape(-1, out)
    y = bf16_kernels.linear(Tensor(x), Tensor(w)).asnumpy()
    assert y.dtype == np.float32 and y.shape == x_shape[:-1] + (out,)
    check(y.reshape(-1, out), bf16(x2), bf16(w).T)
    dx, dw = grads(bf16_kernels.linear, (Tensor(x), Tensor(w)), Tensor(dy))
    check(dx.reshape(-1, x_shape[-1]), bf16(dy2), bf16(w))                  # dx = round(dy) round(W)
    check(dw, bf16(dy2).T, bf16(x2))                                        # dW = round(dy)^T round(x)
    # the float32 kernel on the same inputs is outside the bound: the rounding is what is checked
    from msllm.kernels import cpu_kernels

    f32 = cpu_kernels().linear(Tensor(x), Tensor(w)).asnumpy().reshape(-1, out)
    with pytest.raises(AssertionError):
        check(f32, bf16(x2), bf16(w).T)


@pytest.mark.parametrize("rows,inp,out", [(3, 576, 192), (512, 576, 1537), (9, 37, 5)], ids=["decode", "prefill", "odd"])
def test_bfloat16_weights_are_taken_as_stored(bf16_kernels, pynative, gemm_path, rows, inp, out):
    """Inference with ``param_init_type`` and ``compute_dtype: bfloat16``: the weight arrives in
    bfloat16 (csrc/gemm_bf16.cc ``gemm_bf16_weights``); x is rounded, W's values used as they are.
    Within the bound of the reference, and the same as the float32-weight entry on W's values."""
    import mindspore as ms

    r = seeded_rng(SEED + 2)
    x = r.standard_normal((rows, inp)).astype(np.float32)
    w16 = Tensor((r.standard_normal((out, inp)) * 0.1).astype(np.float32), ms.bfloat16)
    wv = w16.astype(ms.float32).asnumpy()
    y = bf16_kernels.linear(Tensor(x), w16).asnumpy()
    check(y, bf16(x), wv.astype(np.float64).T)
    same = bf16_kernels.linear(Tensor(x), Tensor(wv)).asnumpy()
    np.testing.assert_allclose(y, same, rtol=0, atol=BOUND * float(np.abs(bf16(x)) .max() * np.abs(wv).sum(1).max()))


def test_rows_known_only_at_run_time(bf16_kernels, graph_mode, gemm_path):
    """The output head under the compact loss (``linear_dynamic_rows``: C++ shape inference of the
    bf16 entry points, csrc/gemm_bf16.cc) in a compiled graph, rows picked by nonzero()."""

    class Head(nn.Cell):
        def construct(self, h, w, keep):
            rows = ops.gather(h, ops.reshape(ops.nonzero(keep), (-1,)), 0)
            return bf16_kernels.linear_dynamic_rows(rows, w)

    r = seeded_rng(SEED + 1)
    h = r.standard_normal((40, 64)).astype(np.float32)
    w = (r.standard_normal((300, 64)) * 0.1).astype(np.float32)
    keep = r.random(40) < 0.4
    got = Head()(Tensor(h), Tensor(w), Tensor(keep)).asnumpy()
    assert got.shape == (int(keep.sum()), 300)
    check(got, bf16(h[keep]), bf16(w).T)


def test_gemm_dtype_other_than_float32_or_bfloat16_is_refused():
    from msllm.kernels import library_path
    from msllm.kernels.ops import CpuKernels

    with pytest.raises(ValueError, match="gemm_dtype 'float16'"):
        CpuKernels(library_path(), "float16")


def test_nan_and_inf_inputs_propagate(bf16_kernels, pynative, gemm_path):
    """Rounding keeps NaN a NaN and infinities infinite (a NaN turned into a number by the rounding
    would hide a diverged step from the loss-scale overflow check)."""
    x = np.ones((4, 8), np.float32)
    x[1, 3], x[2, 0] = np.nan, np.inf
    y = bf16_kernels.linear(Tensor(x), Tensor(np.full((5, 8), 0.5, np.float32))).asnumpy()
    assert np.isnan(y[1]).all() and np.isposinf(y[2]).all() and np.isfinite(y[[0, 3]]).all()
