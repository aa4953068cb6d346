"""Learning-rate schedules, precomputed per step (the optimizer indexes them by its global step)."""

from __future__ import annotations

import math

import numpy as np

from msllm.config import LrScheduleConfig


def cosine_with_warmup(total_steps: int, learning_rate: float, lr_end: float, warmup_steps: int) -> np.ndarray:
    """Per-step learning rates, shape (total_steps,) float32.

    Step s (0-based) of W warmup steps: ``lr * (s + 1) / W`` (linear warmup, never 0 on the
    first step); afterwards cosine decay (Loshchilov & Hutter 2017, SGDR eq. 5, one cycle):
    ``lr_end + (lr - lr_end) * (1 + cos(pi * p)) / 2`` with ``p = (s - W) / max(1, S - W)``.
    Same shape as MindFormers' ``CosineWithWarmUpLR`` and HF ``get_cosine_schedule_with_warmup``
    (the latter with lr_end = 0).
    """
    out = np.empty(total_steps, dtype=np.float64)
    for s in range(total_steps):
        if s < warmup_steps:
            out[s] = learning_rate * (s + 1) / warmup_steps
        else:
            p = (s - warmup_steps) / max(1, total_steps - warmup_steps)
            out[s] = lr_end + (learning_rate - lr_end) * 0.5 * (1.0 + math.cos(math.pi * p))
    return out.astype(np.float32)


def build_schedule(cfg: LrScheduleConfig, total_steps: int) -> np.ndarray:
    """Per-step learning rates for ``cfg`` over the run's ``total_steps`` optimizer steps.

    ``cfg.total_steps`` (MindFormers' key; -1 = the run's length) is the length of the schedule:
    warmup (``warmup_ratio`` of it, or ``warmup_steps``) and the cosine decay span it, and steps
    past it stay at ``lr_end`` (as MindFormers' ``CosineWithWarmUpLR`` holds the end value once its
    decay is over). A run shorter than ``cfg.total_steps`` stops part-way down the curve.
    """
    if cfg.type == "constant":
        return np.full(total_steps, cfg.learning_rate, dtype=np.float32)
    span = cfg.total_steps if cfg.total_steps > 0 else total_steps
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * span)
    curve = cosine_with_warmup(span, cfg.learning_rate, cfg.lr_end, warmup)
    if span >= total_steps:
        return curve[:total_steps]
    return np.concatenate([curve, np.full(total_steps - span, cfg.lr_end, np.float32)])
