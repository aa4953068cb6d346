"""lr_schedule.total_steps bounds the schedule (MindFormers' CosineWithWarmUpLR semantics), checked
against hand-computed values of the cosine formula."""

import math

import numpy as np
import pytest

from msllm.config import LrScheduleConfig
from msllm.errors import MsllmError
from msllm.training.schedule import build_schedule


def reference(step, total, lr, lr_end, warmup):
    """Linear warmup then half-cosine from lr to lr_end over ``total`` steps (by hand)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return lr_end + (lr - lr_end) * 0.5 * (1 + math.cos(math.pi * p))


def test_total_steps_minus_one_spans_the_run():
    cfg = LrScheduleConfig(learning_rate=1e-3, lr_end=1e-5, warmup_ratio=0.1, total_steps=-1)
    lr = build_schedule(cfg, 50)
    assert lr.shape == (50,)
    np.testing.assert_allclose(lr, [reference(s, 50, 1e-3, 1e-5, 5) for s in range(50)], rtol=1e-6)


def test_longer_total_steps_stops_part_way_down_the_curve():
    cfg = LrScheduleConfig(learning_rate=1e-3, lr_end=0.0, warmup_ratio=0.1, total_steps=200)
    lr = build_schedule(cfg, 50)
    # warmup is 10% of total_steps (20 steps), not of the run (5)
    np.testing.assert_allclose(lr, [reference(s, 200, 1e-3, 0.0, 20) for s in range(50)], rtol=1e-6)
    assert lr[-1] > 0.9e-3  # far from the end of a 200-step decay


def test_shorter_total_steps_holds_lr_end_afterwards():
    cfg = LrScheduleConfig(learning_rate=1e-3, lr_end=1e-4, warmup_steps=2, total_steps=10)
    lr = build_schedule(cfg, 25)
    np.testing.assert_allclose(lr[:10], [reference(s, 10, 1e-3, 1e-4, 2) for s in range(10)], rtol=1e-6)
    assert np.all(lr[10:] == np.float32(1e-4))


@pytest.mark.parametrize("bad", [0, -2])
def test_bad_total_steps_rejected(bad):
    with pytest.raises(MsllmError, match="total_steps"):
        LrScheduleConfig(total_steps=bad).validate("lr_schedule")
