"""The DPO loss family (msllm.training.dpo.dpo_losses) against float64 numpy transcriptions of the published
formulas, including what TRL 1.16's ``sigmoid`` no longer has: conservative DPO's label smoothing (Mitchell 2023;
TRL < 1.0 ``dpo_loss``, LLaMA-Factory / MindSpeed-LLM ``sigmoid``); and the ``dpo`` config section's checks.
(The loss on a real model against TRL itself: tests/training/test_dpo_trl.py.)"""

import numpy as np
import pytest

from msllm.config import DPOConfig
from msllm.errors import MsllmError

SEED = 7
BETA = 0.3


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def reference(lc, lr, rc, rr, nc, nr, loss_type, eps):
    d = (lc - rc) - (lr - rr)
    if loss_type == "sigmoid":
        return -(1 - eps) * _log_sigmoid(BETA * d) - eps * _log_sigmoid(-BETA * d)
    if loss_type == "hinge":
        return np.maximum(0.0, 1 - BETA * d)
    return ((lc - rc) / nc - (lr - rr) / nr - 1 / (2 * BETA)) ** 2


@pytest.mark.parametrize("loss_type, eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0)])
def test_losses_equal_the_formulas(pynative, loss_type, eps):
    import mindspore as ms

    from msllm.training.dpo import dpo_losses

    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    lc, lr, rc, rr = (-rng.uniform(1, 80, 16) for _ in range(4))
    nc, nr = rng.integers(1, 40, 16).astype(np.float64), rng.integers(1, 40, 16).astype(np.float64)
    got = dpo_losses(*[ms.Tensor(x.astype(np.float32)) for x in (lc, lr, rc, rr, nc, nr)], BETA, loss_type,
                     eps).asnumpy()
    want = reference(lc, lr, rc, rr, nc, nr, loss_type, eps)
    assert got.shape == (16,) and np.ptp(want) > 0.1     # a spread of values, not one point
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, words", [
    (dict(loss_type="kto"), "loss_type"), (dict(beta=0.0), "beta"), (dict(label_smoothing=0.5), "label_smoothing"),
    (dict(loss_type="ipo", label_smoothing=0.1), "sigmoid only"), (dict(ftx=-1.0), "ftx"),
])
def test_bad_dpo_section_is_refused_by_key(kw, words):
    with pytest.raises(MsllmError, match=words):
        DPOConfig(**kw).validate("dpo")
