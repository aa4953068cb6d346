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


@pytest.mark.parametrize("compact", [True, False])
def test_sequence_logps_equal_float64_log_softmax_of_the_models_logits(pynative, compact):
    """SequenceLogps (both paths: the head at the K target positions only, and at every position) against
    float64 log-softmax of the same model's logits; rows with many, few and no completion tokens."""
    import mindspore as ms

    from msllm.models.llama.config import LlamaConfig
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.dpo import SequenceLogps

    print("seed", SEED)
    ms.set_seed(SEED)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=96,
                      seq_length=24)
    model = LlamaForCausalLM(cfg, compact_loss=compact, fast_paths=True)
    model.set_train(False)
    rng = np.random.default_rng(SEED)
    n, t = 4, 24
    tokens = rng.integers(0, 101, (n, t)).astype(np.int32)
    targets = rng.integers(0, 101, (n, t)).astype(np.int32)
    targets[0, :5] = -100          # a prompt, then a completion
    targets[1, :20] = -100         # a short completion
    targets[2, :] = -100           # no completion at all
    targets[3, 10:] = -100         # a completion followed by padding
    got_lp, got_n = SequenceLogps(model)(ms.Tensor(tokens), ms.Tensor(targets))
    logits = model.logits(ms.Tensor(tokens)).asnumpy().astype(np.float64)          # (N, T, V)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    mask = targets != -100
    want = np.where(mask, np.take_along_axis(logp, np.maximum(targets, 0)[..., None], -1)[..., 0], 0.0).sum(-1)
    np.testing.assert_allclose(got_n.asnumpy(), mask.sum(-1))
    np.testing.assert_allclose(got_lp.asnumpy(), want, rtol=1e-5, atol=1e-4)
    assert got_lp.asnumpy()[2] == 0.0 and abs(want[0]) > 1.0


class _Votes:
    """Two data-parallel ranks' agreement (RankAgreement.sums), the other rank voting ``other``."""

    def __init__(self, other):
        self.world_size, self.other = 2, other

    def sums(self, values):
        return [v + o for v, o in zip(values, self.other)]


def test_pair_batches_are_cut_to_the_longest_pair_in_width_buckets(pynative):
    import mindspore as ms

    from msllm.training.dpo import cut_pair_batch, pair_widths

    assert pair_widths(256) == [32, 64, 128, 256] and pair_widths(32) == [32] and pair_widths(200) == [32, 64, 128, 200]
    ids = np.arange(2 * 2 * 257, dtype=np.int32).reshape(2, 2, 257)
    labels = np.full((2, 2, 257), -100, np.int32)
    labels[0, 1, 90] = 5                      # the batch's last completion token: target position 89
    labels[1, 0, 30:40] = 7
    ref = ms.Tensor(np.zeros((2, 2), np.float32))
    out = cut_pair_batch((ms.Tensor(ids), ms.Tensor(labels), ref), -100)
    assert out[0].shape == (2, 2, 129) and out[1].shape == (2, 2, 129) and out[2] is ref
    np.testing.assert_array_equal(out[0].asnumpy(), ids[..., :129])
    np.testing.assert_array_equal(out[1].asnumpy(), labels[..., :129])
    # another rank needing the full width wins; one needing less does not
    assert cut_pair_batch((ms.Tensor(ids), ms.Tensor(labels)), -100, _Votes([0, 0, 0, 1]))[0].shape == (2, 2, 257)
    assert cut_pair_batch((ms.Tensor(ids), ms.Tensor(labels)), -100, _Votes([1, 0, 0, 0]))[0].shape == (2, 2, 129)
    labels[1, 1, 256] = 3                     # a completion reaching the row's end: nothing to cut
    assert cut_pair_batch((ms.Tensor(ids), ms.Tensor(labels)), -100)[0].shape == (2, 2, 257)
