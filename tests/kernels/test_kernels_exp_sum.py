"""Sums of exponentials over a vocabulary-long row (``exp_sum`` / ``exp_shift_sum`` in csrc/vec.h, which the
cross-entropy, attention and decode attention kernels use) are summed in blocks of 256 terms: the log-sum-exp
of the cross-entropy kernel against float64's, with no drift downwards.

Before the blocks, each of AVX2's 8 lanes summed 6144 of SmolLM2's 49152 logits in one running float32 sum, and
every term below half a unit in the last place of that sum was lost: over this test's rows the log-sum-exp came
out low by 2.7e-6 on average (6.0e-6 at most; Qwen2's vocabulary 1.3e-5, 2.6e-5 at most), and SmolLM2's
packed-SFT loss missed its float64 reference by 1.4e-5 on an AMD Zen 3 (tests/models/test_packing_parity.py).
With the blocks: mean 3e-8, at most 7e-7 (Qwen2's: 1.6e-7, 1.1e-6). The kernel is
called through ctypes (no MindSpore), on the instruction set this build was compiled for."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from kerneltest_helpers import call_aot, seeded_rng

SEED = 20261207


@pytest.fixture(scope="module")
def lib():
    from msllm.kernels import build, library_path

    build.build(verbose=False)
    return ctypes.CDLL(library_path())


@pytest.mark.parametrize("vocab", [49152, 151936])   # SmolLM2's, Qwen2's
def test_log_sum_exp_over_a_vocabulary_has_no_drift(lib, vocab):
    r = seeded_rng(SEED + vocab)
    n = 48
    z = (r.standard_normal((n, vocab)) * 3.0).astype(np.float32)   # logits spread as a trained model's
    y = r.integers(0, vocab, n).astype(np.int32)
    out = np.zeros((n, 2), np.float32)
    assert call_aot(lib, "msllm_cross_entropy", [z, y], [out]) == 0
    z64 = z.astype(np.float64)
    m = z64.max(axis=1)
    lse = m + np.log(np.exp(z64 - m[:, None]).sum(axis=1))
    err = out[:, 1].astype(np.float64) - lse
    print(f"vocab {vocab}: log-sum-exp error mean {err.mean():.3g}, max |.| {np.abs(err).max():.3g} "
          f"(lse ~{lse.mean():.1f})")
    # float32 rounding of the result alone is up to 1e-6 at lse ~ 15; one running sum per lane drifted 2.5e-6
    assert abs(err.mean()) <= 3e-7
    assert np.abs(err).max() <= 2e-6
    nll = out[:, 0].astype(np.float64) - (lse - z64[np.arange(n), y])
    assert np.abs(nll).max() <= 4e-6
