"""Direct preference optimization (Rafailov et al. 2023, "Direct Preference Optimization: Your
Language Model is Secretly a Reward Model") as a network the ordinary train step trains.

:class:`DPONetwork` takes the pair batch in the train step's two inputs: ``input_ids`` and
``labels`` (B, 2, L) int32, row 0 of the middle axis the chosen sequence, row 1 the rejected one
(the MindRecord columns ``chosen_input_ids`` / ``rejected_input_ids`` and their labels, stacked
by :mod:`msllm.data.dataset`; ``tokens = ids[:, :, :-1]``, ``targets = labels[:, :, 1:]``, targets
``-100`` outside the completion). So gradient accumulation (slices of the batch axis), data
parallel (the gradient all-reduce), loss scaling, clipping, checkpoints and resume are the SFT
train step's, unchanged.

Sequence log-probabilities (TRL 1.16.0 ``trl/trainer/dpo_trainer.py`` ``_compute_loss``: per-token
log-probs of the completion tokens summed over the sequence): ``logps = sum_t mask_t *
log_softmax(z_t)[y_t]``, for chosen and rejected in one forward pass over the (2B, T) batch.

Reference log-probs: a model that is not trained, run on the same batch in the same step under
``stop_gradient``: for a full fine-tune a frozen copy of the starting weights (``requires_grad``
False, names prefixed ``reference.``, not saved); for LoRA the same network's base weights
without the adapters, i.e. a second LLaMA cell that *shares* the frozen base Parameters (no second
copy of the weights; TRL does the same with PEFT's ``disable_adapter``). With ``dpo.precompute_ref``
(TRL's ``precompute_ref_log_probs``) the reference's values are computed once before the first step
(:mod:`msllm.training.dpo_values`) and :class:`DPOPrecomputedNetwork` takes them as a third input: no
reference model at all during training.

Losses (``d = (logps_c - ref_c) - (logps_r - ref_r)``, mean over the pairs; TRL 1.16.0
``_compute_loss``):

* ``sigmoid``: ``-(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)``; eps =
  ``label_smoothing`` (conservative DPO, Mitchell 2023; the form of TRL < 1.0 and of MindSpeed-LLM's
  / LLaMA-Factory's ``sigmoid``; TRL 1.16's ``sigmoid`` is the eps = 0 case and moved eps to ``robust``);
* ``ipo``: ``(d' - 1 / (2 beta))^2`` with ``d'`` the log-ratios divided by each completion's token
  count (TRL's length-normalised IPO, Azar et al. 2023 eq. 17);
* ``hinge``: ``relu(1 - beta d)`` (SLiC, Zhao et al. 2023).

``ftx`` > 0 adds ``ftx * mean(-logps_c / n_c)`` (the chosen completion's per-token NLL;
LLaMA-Factory ``src/llamafactory/train/dpo/trainer.py`` ``pref_ftx``, which MindSpeed-LLM follows).

Metrics (TRL's names, batch means on this rank): ``rewards/chosen`` = mean beta (logps_c - ref_c),
``rewards/rejected``, ``rewards/margins`` = mean of their difference, ``rewards/accuracies`` = share
of pairs with chosen reward > rejected reward, ``logps/chosen``, ``logps/rejected``.
"""

from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen", "logps/rejected")


def dpo_losses(logps_c, logps_r, ref_c, ref_r, n_c, n_r, beta: float, loss_type: str, label_smoothing: float = 0.0):
    """Per-pair DPO losses (B,) float32 from (B,) float32 summed completion log-probs of the policy
    and the reference, and (B,) float32 completion token counts (IPO's normalisation). Formulas in
    the module doc. Works on MindSpore tensors (in or out of a graph)."""
    chosen, rejected = logps_c - ref_c, logps_r - ref_r
    if loss_type == "ipo":
        d = chosen / ops.maximum(n_c, 1.0) - rejected / ops.maximum(n_r, 1.0)
        return (d - 1.0 / (2.0 * beta)) ** 2
    z = beta * (chosen - rejected)
    if loss_type == "hinge":
        return ops.relu(1.0 - z)
    softplus = ops.Softplus()
    loss = softplus(-z)                                           # -log sigmoid(z)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * softplus(z)   # -log sigmoid(-z) = softplus(z)
    return loss


class SequenceLogps(nn.Cell):
    """tokens (N, T) int32, targets (N, T) int32 -> (summed completion log-probs (N,), completion
    token counts (N,)) float32, through ``model`` (a :class:`~msllm.models.llama.model.LlamaForCausalLM`).
    Ignored targets (``ignore_token_id``) contribute nothing.

    With the model's ``compact_loss`` (its default with msllm's CPU kernels) the output head and the
    log-softmax run only at the K positions that have a target, as the SFT loss does
    (:meth:`LlamaForCausalLM.lm_loss`), and each row's sum is a segment sum over its kept positions:
    in a DPO batch the prompt and the padding are most of the (N, T) positions, and the (N*T, C) x
    (C, V) head is a large share of the step at a 49,152-token vocabulary. The same numbers up to float rounding; TRL's reference test covers both paths
    (``tests/training/test_dpo_trl.py``). K varies per batch: that part of the graph has a dynamic shape.
    """

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model
        self.ignore = model.config.ignore_token_id
        self.compact = bool(getattr(model, "compact_loss", False))
        self.log_softmax = ops.LogSoftmax(-1)
        self.gather = ops.GatherD()
        self.segment_sum = ops.UnsortedSegmentSum()
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()

    def construct(self, tokens, targets):
        n, t = tokens.shape
        h = self.model.model(tokens)                                            # (N, T, C)
        if not self.compact:
            logits = self.model.logits_of(h)                                    # (N, T, V) float32
            v = logits.shape[-1]
            mask = self.cast(targets != self.ignore, ms.float32)                # (N, T)
            safe = self.reshape(ops.maximum(targets, 0), (n * t, 1))           # ignored -> id 0
            lp = self.gather(self.log_softmax(self.reshape(logits, (n * t, v))), 1, safe)  # (N*T, 1)
            lp = self.reshape(lp, (n, t)) * mask
            return lp.sum(-1), mask.sum(-1)
        hk, tgt, rows = self.model.supervised_rows(h, targets)                  # (K+1, C), (K+1,), (K+1,)
        logp = self.log_softmax(self.model.head(hk))                            # (K+1, V) float32
        mask = self.cast(tgt != self.ignore, ms.float32)                        # (K+1,)
        lp = self.reshape(self.gather(logp, 1, self.reshape(ops.maximum(tgt, 0), (-1, 1))), (-1,)) * mask
        seq = self.cast(rows // t, ms.int32)                                    # (K+1,) the row of each
        return self.segment_sum(lp, seq, n), self.segment_sum(mask, seq, n)


MIN_PAIR_TOKENS = 32    # the narrowest width a pair batch is cut to (then powers of two)


def pair_widths(tokens: int) -> list[int]:
    """The widths (token positions) a pair batch of ``tokens`` positions may be cut to: powers of two
    from :data:`MIN_PAIR_TOKENS` below ``tokens``, then ``tokens`` itself (one compiled step each)."""
    widths, w = [], MIN_PAIR_TOKENS
    while w < tokens:
        widths.append(w)
        w *= 2
    return widths + [tokens]


def cut_pair_batch(batch, ignore: int, agree=None):
    """A DPO batch cut to its longest pair: ``batch`` = (input_ids, labels[, ref_logps]) with ids / labels
    (B, 2, L) MindSpore tensors -> the same with (B, 2, w + 1), w the narrowest of :func:`pair_widths`
    (L - 1) that holds every completion token of the batch (the last target of any row), agreed over the
    data-parallel ranks through ``agree`` (:class:`msllm.training.control.RankAgreement`: every rank takes
    the widest rank's width, so all ranks run the same shapes).

    Why: the MindRecord's rows are ``seq_length + 1`` wide whatever the pair, and the padding after a
    pair's last token changes none of its log-probs (causal attention; the padding's targets are
    ignored), so computing it is waste: on SmolLM2's Alpaca pairs at seq 256 a step held 3.0x the real
    tokens. TRL pads each batch to its longest pair for the same reason
    (``trl/trainer/dpo_trainer.py``, its data collator). Widths are bucketed so that few graphs compile.
    """
    from mindspore import Tensor

    labels = batch[1].asnumpy()                                              # (B, 2, L)
    tokens = labels.shape[-1] - 1
    has = np.nonzero((labels[..., 1:] != ignore).any(axis=(0, 1)))[0]
    need = int(has.max()) + 1 if has.size else 1                             # positions up to the last target
    widths = pair_widths(tokens)
    k = next(i for i, w in enumerate(widths) if w >= need)
    if agree is not None and agree.world_size > 1:
        votes = agree.sums([1.0 if i == k else 0.0 for i in range(len(widths))])
        k = max(i for i, v in enumerate(votes) if v > 0)
    if widths[k] >= tokens:
        return batch
    w = widths[k] + 1
    return (Tensor(batch[0].asnumpy()[..., :w]), Tensor(labels[..., :w])) + tuple(batch[2:])


def _owner(cell, dotted: str):
    """The sub-cell of ``cell`` holding parameter ``dotted`` and the attribute name."""
    path, attr = dotted.rsplit(".", 1)
    sub = cell
    for part in path.split("."):
        sub = sub._cells[part] if part in sub._cells else getattr(sub, part)
    return sub, attr


def build_reference(policy, share_frozen: bool, fast_paths: bool, device: str):
    """The reference model of ``policy`` (a :class:`LlamaForCausalLM`, after LoRA if any): a new
    LLaMA cell of the same config whose every Parameter is either ``policy``'s own frozen one
    (``share_frozen``: LoRA, the base weights are frozen, so the reference is the base without
    adapters and costs no memory) or a frozen copy of ``policy``'s current value (full fine-tune),
    renamed ``reference.<name>`` so it is neither trained nor saved with the policy."""
    from msllm.models.llama.model import LlamaForCausalLM

    ref = LlamaForCausalLM(policy.config, fast_paths=fast_paths, device=device)
    own = dict(policy.parameters_and_names())
    for name, _ in list(ref.parameters_and_names()):
        src = own.get(name)
        if src is None:
            raise ValueError(f"reference model parameter {name} has no counterpart in the policy")
        sub, attr = _owner(ref, name)
        if share_frozen:
            if src.requires_grad:
                raise ValueError(f"LoRA reference: base parameter {name} is trainable (expected frozen)")
            value = src
        else:
            value = Parameter(Tensor(src.asnumpy()), name="reference." + name, requires_grad=False)
        # replace in the cell's parameter table (what attribute access reads): Cell.__setattr__
        # would rename a shared Parameter to this cell's path
        sub._params[attr] = value
    ref.set_train(False)
    return ref


class DPONetwork(nn.Cell):
    """The DPO loss of a pair batch (module doc).

    Args:
        policy: the :class:`LlamaForCausalLM` being trained (LoRA applied or not).
        reference: its reference (:func:`build_reference`).
        beta, loss_type, label_smoothing, ftx: :class:`msllm.config.DPOConfig`.

    ``construct(input_ids, labels)``: both (B, 2, L) int32 -> (loss () float32, metrics (6,) float32
    without gradient, :data:`METRIC_NAMES` order). ``n_router_stats`` = 6 tells the train step to
    pass the metrics through with zero sensitivity (the router-stats slot).
    """

    def __init__(self, policy, reference, beta: float = 0.1, loss_type: str = "sigmoid",
                 label_smoothing: float = 0.0, ftx: float = 0.0):
        super().__init__(auto_prefix=False)
        self.policy = policy
        self.config = policy.config
        self.logps = SequenceLogps(policy)
        # precompute_ref (DPOPrecomputedNetwork): no reference model in the network
        self.ref_logps = SequenceLogps(reference) if reference is not None else None
        self.beta, self.loss_type = float(beta), loss_type
        self.label_smoothing, self.ftx = float(label_smoothing), float(ftx)
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()

    @property
    def n_router_stats(self) -> int:
        return len(METRIC_NAMES)

    def pair_logps(self, input_ids, labels):
        """(B, 2, L) pairs -> policy (chosen, rejected), reference (chosen, rejected) summed
        log-probs and completion counts (chosen, rejected), each (B,) float32."""
        b, _, length = input_ids.shape
        tokens = self.reshape(input_ids[:, :, :-1], (2 * b, length - 1))        # (2B, T): c0 r0 c1 r1 ...
        targets = self.reshape(labels[:, :, 1:], (2 * b, length - 1))
        lp, n = self.logps(tokens, targets)                                      # (2B,)
        ref, _ = self.ref_logps(tokens, targets)
        ref = ops.stop_gradient(ref)
        lp, ref, n = self.reshape(lp, (b, 2)), self.reshape(ref, (b, 2)), self.reshape(n, (b, 2))
        return lp[:, 0], lp[:, 1], ref[:, 0], ref[:, 1], n[:, 0], n[:, 1]

    def policy_logps(self, input_ids, labels):
        """(B, 2, L) pairs -> the policy's (chosen, rejected) summed log-probs and completion counts
        (chosen, rejected), each (B,) float32 (no reference pass)."""
        b, _, length = input_ids.shape
        tokens = self.reshape(input_ids[:, :, :-1], (2 * b, length - 1))
        targets = self.reshape(labels[:, :, 1:], (2 * b, length - 1))
        lp, n = self.logps(tokens, targets)
        lp, n = self.reshape(lp, (b, 2)), self.reshape(n, (b, 2))
        return lp[:, 0], lp[:, 1], n[:, 0], n[:, 1]

    def construct(self, input_ids, labels):
        lc, lr, rc, rr, nc, nr = self.pair_logps(input_ids, labels)
        return self.loss_and_metrics(lc, lr, rc, rr, nc, nr)

    def loss_and_metrics(self, lc, lr, rc, rr, nc, nr):
        """(loss () float32, metrics (6,) float32) from the per-pair (B,) values of :meth:`pair_logps`."""
        losses = dpo_losses(lc, lr, rc, rr, nc, nr, self.beta, self.loss_type, self.label_smoothing)
        loss = losses.mean()
        if self.ftx:
            loss = loss + self.ftx * (-lc / ops.maximum(nc, 1.0)).mean()
        reward_c = ops.stop_gradient(self.beta * (lc - rc))
        reward_r = ops.stop_gradient(self.beta * (lr - rr))
        metrics = ops.stack([reward_c.mean(), reward_r.mean(), (reward_c - reward_r).mean(),
                             self.cast(reward_c > reward_r, ms.float32).mean(),
                             ops.stop_gradient(lc).mean(), ops.stop_gradient(lr).mean()])
        return loss, ops.stop_gradient(metrics)


class DPOPrecomputedNetwork(DPONetwork):
    """:class:`DPONetwork` without a reference model (``dpo.precompute_ref``, TRL's
    ``precompute_ref_log_probs``): the reference's summed completion log-probs of each pair were
    computed once with the starting weights (:mod:`msllm.training.dpo_ref`) and come in as the
    train step's third input.

    ``construct(input_ids, labels, ref_logps)``: ids and labels (B, 2, L) int32, ``ref_logps``
    (B, 2) float32 (chosen, rejected) -> as :class:`DPONetwork` (three inputs, no defaults:
    :class:`msllm.training.step.TrainStep` passes a third input through a three-input cell).
    """

    def __init__(self, policy, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 ftx: float = 0.0):
        super().__init__(policy, None, beta, loss_type, label_smoothing, ftx)

    def construct(self, input_ids, labels, ref_logps):
        lc, lr, nc, nr = self.policy_logps(input_ids, labels)
        ref = ops.stop_gradient(ref_logps)
        return self.loss_and_metrics(lc, lr, ref[:, 0], ref[:, 1], nc, nr)


def metrics_dict(values) -> dict:
    """(6,) metrics -> {TRL name: float}."""
    return {k: float(v) for k, v in zip(METRIC_NAMES, np.asarray(values).reshape(-1))}


def build_dpo_network(policy, dpo_cfg, lora: bool, fast_paths: bool, device: str) -> DPONetwork:
    """:class:`DPONetwork` around ``policy`` with its reference (frozen copy, or the shared base for LoRA);
    with ``dpo_cfg.precompute_ref`` a :class:`DPOPrecomputedNetwork` (no reference model in it)."""
    if dpo_cfg.precompute_ref:
        return DPOPrecomputedNetwork(policy, dpo_cfg.beta, dpo_cfg.loss_type, dpo_cfg.label_smoothing, dpo_cfg.ftx)
    reference = build_reference(policy, share_frozen=lora, fast_paths=fast_paths, device=device)
    return DPONetwork(policy, reference, dpo_cfg.beta, dpo_cfg.loss_type, dpo_cfg.label_smoothing, dpo_cfg.ftx)


def reference_source(load_checkpoint: str, resumed: str | None) -> str:
    """Where a full fine-tune's reference weights come from: ``load_checkpoint`` (absolute) at the start;
    on resume the ``dpo_reference`` recorded in the resumed checkpoint's manifest (``load_checkpoint``
    may then name the run's own checkpoints, MindFormers' resume convention).

    Raises MsllmError: a resumed checkpoint without that record, and no load_checkpoint to fall back on."""
    import os

    from msllm.errors import MsllmError
    from msllm.formats.manifest import read_sidecar

    if resumed is None:
        return os.path.abspath(load_checkpoint) if load_checkpoint else ""
    recorded = (read_sidecar(resumed) or {}).get("dpo_reference")
    if recorded:
        return recorded
    if not load_checkpoint:
        raise MsllmError(f"{resumed}: its manifest records no dpo_reference (the starting weights of the DPO "
                         "reference); set load_checkpoint to them")
    return os.path.abspath(load_checkpoint)


def fill_reference(network: DPONetwork, start: str | None, rank: int = 0) -> None:
    """Set a full fine-tune's frozen reference copies (``reference.<name>``) to the starting weights:
    from the policy as it is now (``start`` None: right after the starting weights were loaded), or
    from the checkpoint / HF directory ``start`` (a resumed run: the policy has moved on; the copies
    are not saved in checkpoints, :func:`msllm.training.checkpoint.save_checkpoint`)."""
    from msllm.training.checkpoint import REFERENCE_PREFIX

    ref = network.ref_logps.model
    params = [p for p in ref.get_parameters() if p.name.startswith(REFERENCE_PREFIX)]
    if start is None:
        own = dict(network.policy.parameters_and_names())
        for p in params:
            p.set_data(Tensor(own[p.name[len(REFERENCE_PREFIX):]].asnumpy()))
        return
    from msllm.errors import MsllmError
    from msllm.convert.starting import load_base_into

    if not start:
        raise MsllmError("resume_training with dpo needs load_checkpoint (the starting weights the reference is "
                         "rebuilt from: its frozen copies are not saved in the run's checkpoints)")
    for p in params:   # load_base_into matches the model's own names
        p.name = p.name[len(REFERENCE_PREFIX):]
    try:
        load_base_into(ref, start, rank)
    finally:
        for p in params:
            p.name = REFERENCE_PREFIX + p.name
