"""Helpers of the kernel tests (tests/kernels): the closeness rule, a printed seed, gradients, a kernel
called through ctypes."""

from __future__ import annotations

import ctypes

import numpy as np

from msllm.kernels import aot_args  # noqa: F401  (the kernel tests' and benchmarks' marshalling)


def close(actual, expected, rtol: float = 1e-5):
    """Assert max |actual - expected| <= rtol * max |expected| + 1e-6 (float64 comparison, equal shapes)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = np.abs(actual - expected).max()
    bound = rtol * np.abs(expected).max() + 1e-6
    assert err <= bound, f"max abs error {err:.3e} > {bound:.3e}"


def seeded_rng(seed: int) -> np.random.Generator:
    """numpy's default generator at ``seed``, the seed printed (the test log says which one ran)."""
    print("seed", seed)
    return np.random.default_rng(seed)


def grads(fn, args, dout):
    """Gradients of sum(fn(*args) * dout) with respect to every argument (numpy arrays)."""
    from mindspore import ops

    def loss(*xs):
        return (fn(*xs) * dout).sum()

    return [g.asnumpy() for g in ops.grad(loss, grad_position=tuple(range(len(args))))(*args)]


def call_aot(lib, name, inputs, outputs):
    """``name`` of the ctypes library ``lib`` on numpy arrays (MindSpore's AOT signature); the
    outputs are written in place; returns the kernel's return code."""
    arrays = [np.ascontiguousarray(a) for a in inputs] + list(outputs)
    args, _keep = aot_args(arrays)
    return getattr(lib, name)(*args)
