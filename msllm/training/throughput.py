"""Throughput accounting: tokens/s/device (tgs), achieved TFLOPs and MFU.

MFU (model FLOPs utilisation, PaLM: Chowdhery et al. 2022, appendix B) =
``tgs * flops_per_token / peak_flops_per_device``, with ``flops_per_token = 6N + 12 L H D T``
(:meth:`msllm.models.llama.config.LlamaConfig.train_flops_per_token`). Recomputation is not
counted (that would be hardware FLOPs utilisation, HFU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np


def measure_cpu_peak_tflops(n: int = 2048, repeats: int = 3) -> float:
    """Best fp32 matmul rate of MindSpore's own CPU MatMul kernel in this process, in TFLOP/s
    (2 n^3 FLOPs per n x n matmul).

    Used as the CPU "peak" for MFU because a CPU has no single published number for the cores a
    rank gets; it is what a large dense fp32 matmul reaches here with the same kernels the model
    uses (numpy's BLAS is 5x slower on these machines, so it would overstate MFU). Ranks that
    share a machine measure at the same time and so each see their share of it.
    """
    import mindspore as ms
    from mindspore import ops

    rng = np.random.default_rng(0)
    a = ms.Tensor(rng.standard_normal((n, n), dtype=np.float32))
    b = ms.Tensor(rng.standard_normal((n, n), dtype=np.float32))
    matmul = ops.MatMul()
    matmul(a, b).asnumpy()  # warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        matmul(a, b).asnumpy()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best / 1e12


@dataclass
class Throughput:
    """Per-step throughput numbers for one device.

    tokens_per_step: tokens one device processes per optimizer step (batch x accum x seq_length).
    flops_per_token: model FLOPs per trained token.
    peak_tflops: the device's peak in TFLOP/s, or None (then MFU is not reported).
    """

    tokens_per_step: int
    flops_per_token: float
    peak_tflops: Optional[float]

    def tgs(self, step_seconds: float) -> float:
        """Tokens per second per device."""
        return self.tokens_per_step / step_seconds

    def tflops(self, step_seconds: float) -> float:
        """Achieved model TFLOP/s per device."""
        return self.tgs(step_seconds) * self.flops_per_token / 1e12

    def mfu(self, step_seconds: float) -> Optional[float]:
        """Model FLOPs utilisation in [0, 1], or None without a peak."""
        if not self.peak_tflops:
            return None
        return self.tflops(step_seconds) / self.peak_tflops
