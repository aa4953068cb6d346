"""One training step as one graph: forward, backward, gradient all-reduce, loss-scale update,
overflow skip, global-norm clipping and the optimizer update, compiled together (GRAPH_MODE).

The pattern is MindSpore's ``nn.TrainOneStepWithLossScaleCell``, written out because that cell's
overflow check uses NPU float-status kernels that do not exist on CPU; here overflow is
"the global gradient norm is not finite", i.e. some gradient is inf/NaN (or the fp32 sum of the
squared scaled gradients itself overflows, a norm above ~1e19 times the loss scale), which works
on every device.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops


class _WithDocuments(nn.Cell):
    """``network(input_ids, labels, actual_seq_len)`` as a cell of exactly three inputs: MindSpore's
    GradOperation with a sensitivity miscounts the inputs of a construct that has defaults
    ("The parameters number of the function is 3, but the number of provided arguments is 4")."""

    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, input_ids, labels, actual_seq_len):
        return self.network(input_ids, labels, actual_seq_len)


class TrainStep(nn.Cell):
    """Wraps ``network(input_ids, labels) -> loss`` into one optimizer step.

    Args:
        network: a cell returning a scalar fp32 loss from ``(input_ids, labels)``, each
            (B * accum_steps, T+1) int32.
        optimizer: a MindSpore optimizer over ``network``'s trainable parameters.
        loss_scale: ``"dynamic"``, ``"fixed"`` or ``"none"``.
        scale_sense: initial (or fixed) loss scale S; the loss is multiplied by S before the
            backward pass and gradients are divided by S afterwards.
        scale_factor / scale_window: dynamic scale update, MindSpore ``DynamicLossScaleUpdateCell``
            semantics: on overflow S /= factor and the update is skipped; after ``window``
            clean steps S *= factor.
        max_grad_norm: clip the global L2 norm of the (unscaled, reduced) gradients to this
            value; ``None`` disables clipping.
        accum_steps: gradient accumulation: the batch is split into this many micro batches
            along axis 0 and their gradients averaged before one update.
        grad_reducer: callable on the gradient tuple (all-reduce mean for data parallel) or None.
        branch_free_skip: skip an overflowed step without a branch in the graph: the optimizer is
            always called, as ``optimizer(grads, overflow)``, and makes the step an exact no-op
            itself (:class:`msllm.training.adamw.AdamW`, required then). ``False`` (CPU) keeps
            ``if not overflow: optimizer(grads)``, the form of MindSpore's
            ``TrainOneStepWithLossScaleCell`` and MindFormers' ``MFTrainOneStepCell``; MindSpore 2.10's
            kernel-by-kernel backend (Ascend, ``jit_level`` O0/O1) refuses that branch in the dry-run
            (``Can not build a sub graph which contains ConditionSwitch ... by kbk``), so msllm builds
            the branch-free form for every device but CPU (:func:`msllm.training.setup.build_train_step`).
            Both leave parameters, moments and the optimizer's step count bit-identical on a skipped
            step (tests/training/test_training_step_numerics.py).

    ``construct(input_ids, labels[, actual_seq_len])`` returns ``(loss, overflow, loss_scale, grad_norm)``
    (``actual_seq_len`` (B * accum_steps, N) int32: packed rows' document ends, passed to the
    network as its third input; :mod:`msllm.data.packing`):
    fp32 scalar mean loss, bool scalar, fp32 scalar scale used this step, fp32 scalar norm of
    the gradients before clipping; plus ``stats`` (S,) fp32 (averaged over micro batches) when the
    network returns ``(loss, stats)`` (``network.n_router_stats`` = S > 0: a mixture of experts'
    router statistics, :meth:`msllm.models.llama.model.LlamaForCausalLM.return_router_stats`).
    """

    def __init__(self, network, optimizer, loss_scale: str = "dynamic", scale_sense: float = 65536.0,
                 scale_factor: float = 2.0, scale_window: int = 1000, max_grad_norm=1.0,
                 accum_steps: int = 1, grad_reducer=None, branch_free_skip: bool = False):
        super().__init__(auto_prefix=False)
        if branch_free_skip:
            from msllm.training.adamw import AdamW

            if not isinstance(optimizer, AdamW):
                raise TypeError(f"TrainStep(branch_free_skip=True) needs msllm.training.adamw.AdamW, which takes the "
                                f"skip flag; got {type(optimizer).__name__}")
        self.branch_free_skip = branch_free_skip
        self.network = network
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.accum_steps = accum_steps
        self.max_grad_norm = max_grad_norm
        self.dynamic = loss_scale == "dynamic"
        self.use_scale = loss_scale != "none"
        # The scale is a Parameter so it is checkpointed and restored on resume.
        self.loss_scale = Parameter(Tensor(scale_sense if self.use_scale else 1.0, ms.float32),
                                    name="loss_scale", requires_grad=False)
        self.scale_update = (nn.DynamicLossScaleUpdateCell(scale_sense, scale_factor, scale_window)
                             if self.dynamic else None)
        self.grad_reducer = grad_reducer
        self.network_docs = _WithDocuments(network)   # packed rows (a third input)
        self.n_stats = int(getattr(network, "n_router_stats", 0))
        # the stats carry no gradient: their sensitivity is zero
        self.zero_stats = Tensor(np.zeros(max(self.n_stats, 1), np.float32))
        self.hyper_map = ops.HyperMap()
        self.reduce_sum = ops.ReduceSum()
        # the optimizer's one-pass CPU update (msllm.training.adamw.AdamW.cpu_update) and the
        # gradients' sums of squares on the same kernels; it skips an overflowed step without a branch
        self.cpu_update = getattr(optimizer, "cpu_kernels", None) is not None
        if self.cpu_update:
            self.sum_squares = optimizer.cpu_kernels.sum_squares

    def _loss_and_grads(self, ids, lab, sens, seqs=None):
        """(loss, stats or None, gradients) of one (micro) batch; ``seqs``: packed rows' document
        ends (B, N) int32, or None (a compile-time choice: the unpacked graph is unchanged)."""
        if self.n_stats:
            if seqs is None:
                loss, stats = self.network(ids, lab)
                return loss, stats, self.grad(self.network, self.weights)(ids, lab, (sens, self.zero_stats))
            loss, stats = self.network_docs(ids, lab, seqs)
            return loss, stats, self.grad(self.network_docs, self.weights)(ids, lab, seqs, (sens, self.zero_stats))
        if seqs is None:
            return self.network(ids, lab), None, self.grad(self.network, self.weights)(ids, lab, sens)
        return self.network_docs(ids, lab, seqs), None, self.grad(self.network_docs, self.weights)(ids, lab, seqs, sens)

    def _grads(self, input_ids, labels, sens, actual_seq_len=None):
        if self.accum_steps == 1:
            return self._loss_and_grads(input_ids, labels, sens, actual_seq_len)
        micro = input_ids.shape[0] // self.accum_steps
        total_loss = total_stats = total = None
        for i in range(self.accum_steps):                                 # unrolled at compile time
            ids = input_ids[i * micro:(i + 1) * micro]
            lab = labels[i * micro:(i + 1) * micro]
            seqs = None if actual_seq_len is None else actual_seq_len[i * micro:(i + 1) * micro]
            loss, stats, grads = self._loss_and_grads(ids, lab, sens, seqs)
            if total is None:
                total, total_loss, total_stats = grads, loss, stats
            else:
                total = self.hyper_map(ops.add, total, grads)
                total_loss = total_loss + loss
                if self.n_stats:
                    total_stats = total_stats + stats
        inv = 1.0 / self.accum_steps
        if self.n_stats:
            total_stats = total_stats * inv
        return total_loss * inv, total_stats, tuple([g * inv for g in total])

    def _sum_of_squares(self, g):
        """sum(g^2) in fp32 as a scalar. Reduces the last axis first, then the rest: MindSpore's
        CPU ReduceSum over all axes of a matrix at once is ~4x slower (the gradient checks of
        the tiny benchmark model took 0.27 s per step, this 0.03 s; benchmarks/micro_ops.py)."""
        g = ops.cast(g, ms.float32)
        sq = g * g
        if sq.ndim > 1:
            sq = self.reduce_sum(sq, -1)
        return self.reduce_sum(sq)

    def construct(self, input_ids, labels, actual_seq_len=None):
        scale = self.loss_scale * 1.0
        loss, stats, grads = self._grads(input_ids, labels, ops.cast(scale, ms.float32), actual_seq_len)
        if self.grad_reducer is not None:
            grads = self.grad_reducer(grads)
        inv_scale = 1.0 / scale
        # Norm of the unscaled gradients, computed on the scaled ones and multiplied by 1/S
        # (exact for the power-of-two scales the dynamic update keeps). It doubles as the
        # overflow check: the sum of squares is inf/NaN exactly when a gradient is (or when the
        # norm itself exceeds fp32, > ~1e19 * S, which is an overflow too). One pass over the
        # gradients instead of an isfinite pass, an unscale pass and a squaring pass.
        if self.cpu_update:   # msllm's one-pass kernel per gradient (csrc/optim.cc)
            sq = ops.concat([self.sum_squares(g) for g in grads]).sum()
        else:
            sq = ops.stack([self._sum_of_squares(g) for g in grads]).sum()
        grad_norm = ops.sqrt(sq) * inv_scale
        overflow = ops.logical_not(ops.isfinite(grad_norm))
        if self.dynamic:
            overflow = self.scale_update(self.loss_scale, overflow)
        # Unscale and clip in one multiplication: g * (1/S * min(max_norm / (norm + 1e-6), 1)),
        # the torch.nn.utils.clip_grad_norm_ rule; bit-identical to unscaling first because 1/S
        # is a power of two.
        coef = inv_scale
        if self.max_grad_norm is not None:
            coef = coef * ops.minimum(self.max_grad_norm / (grad_norm + 1e-6), 1.0)
        if self.cpu_update:
            # the kernel multiplies by coef itself and writes the Parameters in place behind
            # MindSpore's back: coef then carries a data dependency on every value of the step that
            # reads a parameter (the loss and stats; the gradients through the norm), so every
            # write follows every read (AdamW.cpu_update); an overflowed step writes nothing
            coef = ops.depend(ops.depend(ops.cast(coef, ms.float32), grad_norm), loss)
            if self.n_stats:
                coef = ops.depend(coef, stats)
            loss = ops.depend(loss, self.optimizer.cpu_update(grads, overflow, coef))
        else:
            if self.use_scale or self.max_grad_norm is not None:
                grads = tuple([g * ops.cast(coef, g.dtype) for g in grads])
            if self.branch_free_skip:  # the optimizer turns an overflowed step into an exact no-op itself
                loss = ops.depend(loss, self.optimizer(grads, overflow))
            elif not overflow:
                loss = ops.depend(loss, self.optimizer(grads))
        if self.n_stats:
            return loss, overflow, scale, grad_norm, stats
        return loss, overflow, scale, grad_norm
