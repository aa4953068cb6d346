"""Per-pair DPO values over a whole preference set, split over the data-parallel ranks: the held-out
evaluation (``do_eval``) and the precomputed reference log-probs (``dpo.precompute_ref``).

Every pair is computed by exactly one rank (pairs ``rank::world_size``, in batches of a fixed
size: the last batch is filled with copies of its first pair, whose values are dropped); each
rank writes its values into a zero-filled (N, K) float32 array and one AllReduce sum combines
them. Adding zeros is exact, so every rank ends with the values a single process computes (as long
as a pair's values do not depend on the other pairs of its batch: each sequence is computed on its
own row).

Precomputed reference (TRL 1.16.0 ``trl/trainer/dpo_trainer.py`` ``DPOTrainer._precompute_ref_logps``,
``precompute_ref_log_probs=True``): the reference's summed completion log-probs of every training
pair (and every held-out pair with ``do_eval``) are computed once before the first step, with the
starting weights (full fine-tune: the policy itself, before it has moved; LoRA: the base without the
adapters), then training runs without a reference model. A resumed run recomputes them from the
starting weights (:func:`msllm.training.setup.load_start` does that before loading the resumed
checkpoint), never from the resumed policy.
"""

from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from msllm.errors import MsllmError
from msllm.training.dpo import METRIC_NAMES, SequenceLogps, dpo_losses


def read_pairs(dataset_dir: str, seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of the preference MindRecord(s) under ``dataset_dir`` in file order:
    ``input_ids`` and ``labels`` (N, 2, seq_length + 1) int32, row 0 chosen, row 1 rejected (the
    order :class:`msllm.data.dataset.TrainData` indexes samples in).

    Raises MsllmError: not preference data, wrong seq_length (naming the file), or no pair."""
    from msllm.data.dataset import check_pair_dataset
    from msllm.data.preference import read_preference_arrays

    ids, labels = [], []
    for f in check_pair_dataset(dataset_dir, seq_length):
        a = read_preference_arrays(f)
        if a["chosen_input_ids"].shape[1] != seq_length + 1:
            raise MsllmError(f"{f}: rows of {a['chosen_input_ids'].shape[1]} tokens, expected seq_length + 1 = "
                             f"{seq_length + 1}")
        ids.append(np.stack([a["chosen_input_ids"], a["rejected_input_ids"]], 1))
        labels.append(np.stack([a["chosen_labels"], a["rejected_labels"]], 1))
    if not ids:
        raise MsllmError(f"{dataset_dir}: no preference pairs")
    return np.concatenate(ids).astype(np.int32), np.concatenate(labels).astype(np.int32)


class PairSequenceLogps(nn.Cell):
    """``model`` (a LlamaForCausalLM) on pairs: ids, labels (B, 2, L) int32 -> (B, 4) float32 columns
    (chosen log-probs, rejected log-probs, chosen count, rejected count); summed completion
    log-probs as :class:`msllm.training.dpo.SequenceLogps`."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.logps = SequenceLogps(model)
        self.reshape = ops.Reshape()

    def construct(self, input_ids, labels):
        b, _, length = input_ids.shape
        lp, n = self.logps(self.reshape(input_ids[:, :, :-1], (2 * b, length - 1)),
                           self.reshape(labels[:, :, 1:], (2 * b, length - 1)))
        return ops.concat([self.reshape(lp, (b, 2)), self.reshape(n, (b, 2))], 1)


class NetworkPairValues(nn.Cell):
    """A :class:`~msllm.training.dpo.DPONetwork`'s per-pair values: ids, labels (B, 2, L) -> (B, 6)
    float32 (policy chosen, policy rejected, reference chosen, reference rejected, chosen count,
    rejected count) through :meth:`DPONetwork.pair_logps`."""

    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, input_ids, labels):
        return ops.stack(self.network.pair_logps(input_ids, labels), 1)


def all_pair_values(cell, width: int, input_ids: np.ndarray, labels: np.ndarray, batch_size: int, rank: int,
                    world_size: int, sums) -> np.ndarray:
    """``cell``'s (B, ``width``) rows for all N pairs -> (N, width) float32, identical on every rank
    (module doc). ``sums``: :meth:`msllm.training.control.RankAgreement.sums`."""
    n = input_ids.shape[0]
    mine = np.arange(n)[rank::world_size]
    out = np.zeros((n, width), np.float32)
    for start in range(0, len(mine), batch_size):
        idx = mine[start:start + batch_size]
        full = np.concatenate([idx, np.repeat(idx[:1], batch_size - len(idx))])   # one compiled shape
        out[idx] = cell(Tensor(input_ids[full]), Tensor(labels[full])).asnumpy()[:len(idx)]
    if world_size > 1:
        out = np.asarray(sums(out.reshape(-1).tolist()), np.float32).reshape(n, width)
    return out


def eval_metrics(values: np.ndarray, beta: float, loss_type: str, label_smoothing: float, ftx: float) -> dict:
    """Held-out DPO loss and TRL's metrics from per-pair (N, 6) values (:class:`NetworkPairValues`
    columns): ``{"loss", "eval_rewards/chosen", ...}`` (TRL's evaluation names, ``eval_`` prefix).

    The per-pair losses come from :func:`msllm.training.dpo.dpo_losses` (the training loss's own
    function, float32), their mean and the ``ftx`` term (as :class:`DPONetwork`) and the metrics are
    float64 means over the N pairs: rewards = beta (policy - reference) log-probs, margins their
    difference, accuracies the share of pairs with chosen reward > rejected reward, logps the
    policy's summed completion log-probs."""
    cols = [Tensor(np.ascontiguousarray(values[:, k]), ms.float32) for k in range(6)]
    losses = dpo_losses(*cols, beta, loss_type, label_smoothing).asnumpy().astype(np.float64)
    v = values.astype(np.float64)
    loss = losses.mean()
    if ftx:
        loss += ftx * float(np.mean(-v[:, 0] / np.maximum(v[:, 4], 1.0)))
    rc, rr = beta * (v[:, 0] - v[:, 2]), beta * (v[:, 1] - v[:, 3])
    metrics = [rc.mean(), rr.mean(), (rc - rr).mean(), (rc > rr).mean(), v[:, 0].mean(), v[:, 1].mean()]
    return {"loss": float(loss), **{"eval_" + k: float(m) for k, m in zip(METRIC_NAMES, metrics)}}


def reference_values(model, input_ids: np.ndarray, labels: np.ndarray, batch_size: int, rank: int, world_size: int,
                     sums) -> np.ndarray:
    """The reference's (chosen, rejected) summed completion log-probs of every pair: (N, 2) float32,
    computed with ``model`` (the starting weights: module doc), split over the ranks."""
    values = all_pair_values(PairSequenceLogps(model), 4, input_ids, labels, batch_size, rank, world_size, sums)
    return np.ascontiguousarray(values[:, :2])


class HeldOutPairs:
    """``do_eval`` with dpo: the held-out DPO loss and TRL's metrics of the network being trained
    over every pair of ``dataset_dir`` (:func:`read_pairs`), split over the ranks (module doc).

    ``network``: a :class:`~msllm.training.dpo.DPONetwork` (its reference runs beside the policy), or
    a :class:`~msllm.training.dpo.DPOPrecomputedNetwork` with ``reference`` the pairs' precomputed
    (N, 2) float32 reference log-probs (:func:`reference_values`, before the first step)."""

    def __init__(self, network, input_ids: np.ndarray, labels: np.ndarray, batch_size: int, dpo_cfg,
                 reference: np.ndarray | None = None):
        self.ids, self.labels, self.batch, self.cfg = input_ids, labels, batch_size, dpo_cfg
        self.reference = reference
        if network.ref_logps is None:
            if reference is None or reference.shape != (input_ids.shape[0], 2):
                raise MsllmError("do_eval with dpo.precompute_ref: the held-out pairs' reference log-probs were not "
                                 "precomputed")
            self.cell = PairSequenceLogps(network.policy)
        else:
            self.cell = NetworkPairValues(network)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __call__(self, rank: int, world_size: int, sums) -> dict:
        """``{"loss", "eval_rewards/chosen", ...}`` (:func:`eval_metrics`), identical on every rank."""
        if self.reference is None:
            values = all_pair_values(self.cell, 6, self.ids, self.labels, self.batch, rank, world_size, sums)
        else:
            v = all_pair_values(self.cell, 4, self.ids, self.labels, self.batch, rank, world_size, sums)
            values = np.concatenate([v[:, :2], self.reference, v[:, 2:]], 1)
        c = self.cfg
        return eval_metrics(values, c.beta, c.loss_type, c.label_smoothing, c.ftx)
