"""msllm's AdamW: MindSpore's ``nn.AdamWeightDecay`` with two additions a train step on Ascend needs,
and a one-pass update on msllm's CPU kernels (3. below).

1. **float32 moment states for low-precision parameters** (``state_dtype=float32``): MindFormers'
   ``FP32StateAdamWeightDecay`` (mindformers/core/optim/optim.py: an ``nn.AdamWeightDecay`` whose
   ``adam_m`` / ``adam_v`` are created float32 whatever the parameters' dtype, "to avoid overflow in
   training big model using fp16", and which uses MindSpore's composed update instead of the fused
   kernel off CPU). MindSpore's own ``nn.AdamWeightDecay`` clones the moments in the parameters' dtype
   (``ParameterTuple.clone``), so fp16 parameters get fp16 moments.
2. **a branch-free skipped step** (``construct(gradients, skip)``): when ``skip`` (bool scalar) is
   True the update is an exact no-op — parameters, both moments and ``global_step`` keep their values
   bit for bit — without a data-dependent branch in the graph. :class:`msllm.training.step.TrainStep`
   skips a step whose gradients overflowed; written as ``if not overflow: optimizer(grads)`` (the form
   of MindSpore's ``TrainOneStepWithLossScaleCell`` and MindFormers' ``MFTrainOneStepCell``), MindSpore
   2.10's kernel-by-kernel backend (``jit_level`` O0/O1) on Ascend refuses to build it in the dry-run:
   ``Can not build a sub graph which contains ConditionSwitch or ConditionSwitch by kbk``
   (``graph_scheduler.cc BuildKernelActor``; see docs/dryrun.md).

3. **the CPU update** (:meth:`AdamW.cpu_update`, when built with ``cpu_kernels``): the same rule by
   msllm's ``adamw`` kernel (csrc/optim.cc), one pass per parameter over g, p, m, v with the train
   step's unscale-and-clip factor folded in, parameter and moments written in place. MindSpore's
   AdamWeightDecay kernels and the separate clipping multiplies took 384 ms per step on SmolLM2's
   135M parameters, this 157 ms (benchmarks/optimizer_step.py,
   benchmarks/results/optimizer_step_intel_xeon.json). MindSpore does not know the kernel writes its
   inputs, so nothing but data dependencies orders the writes after the step's reads of the
   parameters: the factor it takes depends on the loss and on every gradient (TrainStep builds it).
   ``tests/training/test_adamw.py`` and ``test_training_step_numerics.py`` compare it with
   ``nn.AdamWeightDecay`` step by step (the same losses, so no write overtook a read).

How the skip is exact: AdamWeightDecay's rule (MindSpore ``nn.AdamWeightDecay`` docstring) is
``m' = b1 m + (1 - b1) g``, ``v' = b2 v + (1 - b2) g^2``, ``p' = p - lr (m' / (sqrt(v') + eps) + wd p)``.
On a skipped step the optimizer is fed ``b1 = b2 = 1``, ``lr = 0`` and ``g = 0`` (the gradients are
replaced, not scaled: an overflowed gradient is inf/NaN and ``0 * inf`` is NaN), so ``m' = 1 * m + 0 * 0
= m`` and ``v' = v`` exactly, and ``p' = p - 0 * finite = p`` exactly (``eps > 0`` keeps the quotient
finite). On a normal step ``where(False, 1, b1)`` is ``b1`` and ``lr * 1`` is ``lr``: the same numbers
as the plain optimizer. ``tests/training/test_adamw.py`` checks both bit for bit on CPU, for the
fused kernel and for the composed update.
"""

from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common.initializer import initializer
from mindspore.nn.optim.adam import _adam_opt, _fused_adam_weight_decay

_zero_if = ops.MultitypeFuncGraph("zero_if")
_cpu_adamw = ops.MultitypeFuncGraph("cpu_adamw")


@_cpu_adamw.register("Function", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor")
def _cpu_adamw_one(kernel, param, m, v, grad, hyper):
    """One parameter's in-place update by msllm's ``adamw`` kernel; its (1,) result."""
    return kernel(param, m, v, grad, hyper)


@_zero_if.register("Tensor", "Tensor")
def _zero_where(skip, grad):
    """``grad`` with every element replaced by 0 when the bool scalar ``skip`` is True."""
    return ops.masked_fill(grad, skip, ops.cast(0, grad.dtype))


def float32_states(params, prefix: str) -> ParameterTuple:
    """Zero-initialised float32 copies of ``params`` named ``prefix.<name>``, each sharing its
    parameter's layout information (``param_info.cloned_obj``, what MindSpore's optimizer sharding
    reads to split a state like its parameter), as MindSpore's ``Parameter.clone`` does but with the
    dtype forced to float32 (MindFormers' ``clone_state``). The data is a deferred ``initializer``:
    nothing is allocated until the graph runs (or at all, under ``no_init_parameters``)."""
    out = []
    for p in params:
        state = Parameter(initializer("zeros", p.shape, ms.float32), name=p.name, requires_grad=False)
        info = p.param_info.clone()
        info.obj = state
        state.param_info = info
        p.param_info.cloned_obj = [*getattr(p.param_info, "cloned_obj", []), state]
        state.is_init = False
        state.name = f"{prefix}.{p.name}"
        out.append(state)
    return ParameterTuple(out)


class AdamW(nn.AdamWeightDecay):
    """``nn.AdamWeightDecay`` (same arguments, same update, same ``adam_m.*`` / ``adam_v.*`` state
    names) plus float32 states and the branch-free skip described in the module docstring.

    Args:
        params, learning_rate, beta1, beta2, eps, weight_decay: as ``nn.AdamWeightDecay``.
        state_dtype: ``None`` (moments in each parameter's dtype, MindSpore's behaviour) or
            ``mindspore.float32`` (MindFormers' FP32StateAdamWeightDecay).

    The fused ``AdamWeightDecay`` kernel (what ``nn.AdamWeightDecay`` runs) is used when every
    parameter is float32; otherwise MindSpore's composed update (``nn.optim.adam._update_run_op``:
    parameter, moments and gradient cast to float32, the rule above, results cast back), which is
    what FP32StateAdamWeightDecay runs off CPU: the fused kernel needs its inputs in one dtype
    (MindSpore 2.10 on the 13B job with fp16 parameters: ``For primitive[AdamWeightDecay], the input
    type must be same. grad: Float32, var: Float16``).

    ``construct(gradients, skip=None)``: gradients, one per parameter in ``self.parameters`` order,
    each the parameter's shape (any float dtype); ``skip`` a bool scalar Tensor or None. Returns
    the tuple of per-parameter results of the update (as ``nn.AdamWeightDecay``).
    """

    def __init__(self, params, learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0,
                 state_dtype=None, cpu_kernels=None):
        super().__init__(params, learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay)
        if state_dtype not in (None, ms.float32):
            raise ValueError(f"AdamW state_dtype={state_dtype}: expected None (the parameters' dtype) or float32")
        low = any(p.dtype != ms.float32 for p in self._parameters)
        if state_dtype == ms.float32 and low:
            self.moments1 = float32_states(self._parameters, "adam_m")
            self.moments2 = float32_states(self._parameters, "adam_v")
        self.use_fused_opt = not low
        self.state_dtype = state_dtype
        self._one = Tensor([1.0], ms.float32)
        self.cpu_kernels = None
        why = self._cpu_update_refused(cpu_kernels, low)
        if why is None:
            self._use_cpu_update(cpu_kernels, beta1, beta2, eps)
        self.cpu_update_note = why   # None: the one-pass CPU update runs (msllm.training.setup logs which)

    def _cpu_update_refused(self, kernels, low: bool):
        """None when :meth:`cpu_update` can run, else why not (one phrase, for the start-up log)."""
        if kernels is None:
            return "msllm's CPU kernels are off or not built"
        if low:
            return "the parameters are not all float32"
        if self.use_parallel or not all(self.optim_filter):
            return "optimizer sharding"
        if self.is_group_lr or self.dynamic_weight_decay:
            return "per-group learning rates or a weight-decay schedule"
        return None

    def _use_cpu_update(self, kernels, beta1, beta2, eps):
        """Set up :meth:`cpu_update`: per parameter the weight decay it gets (``nn.AdamWeightDecay``:
        the group's value where its decay flag is set, else 0) as an index into the distinct values."""
        wds = self.weight_decay if self.is_group else (self.weight_decay,) * len(self._parameters)
        per_param = [float(w.asnumpy()) if isinstance(w, Tensor) else float(w) for w in wds]
        per_param = [w if flag else 0.0 for w, flag in zip(per_param, self.decay_flags)]
        distinct = sorted(set(per_param))
        self._wd_index = tuple(distinct.index(w) for w in per_param)
        # hyper = base + lr e0 + coef e5 + skip e6 (csrc/optim.cc's layout)
        self._hyper_base = tuple(Tensor(np.array([0, beta1, beta2, eps, w, 0, 0, 0], np.float32)) for w in distinct)
        self._e_lr, self._e_coef, self._e_skip = (Tensor(np.eye(8, dtype=np.float32)[i]) for i in (0, 5, 6))
        self.cpu_kernels = kernels

    def cpu_update(self, gradients, skip, coef):
        """The update in one pass per parameter on msllm's CPU kernel (csrc/optim.cc): the rule of
        the module docstring on ``coef * g``, parameter and moments written in place, nothing
        written when ``skip``; bit-exact no-op on a skipped step as :meth:`construct`.

        Args: gradients, one (any float32 shape) per parameter in ``self.parameters`` order; skip:
        bool scalar Tensor; coef: float32 scalar Tensor multiplying every gradient (the train step's
        unscale-and-clip factor). It must depend on every value of the step that reads a parameter
        (the loss, the gradients' norm): the kernel writes the Parameters MindSpore knows nothing
        about, so this data dependency is what orders the writes after the reads
        (:class:`msllm.training.step.TrainStep` builds it). Returns the tuple of (1,) float32
        results to depend on."""
        lr = ops.cast(self.get_lr(), ms.float32).reshape(())   # this step's: read before the count moves
        keep = ops.logical_not(skip)
        self.assignadd(self.global_step, self.global_step_increase_tensor * ops.cast(keep, ms.int32))
        dyn = self._e_lr * lr + self._e_coef * ops.cast(coef, ms.float32).reshape(()) + \
            self._e_skip * ops.cast(skip, ms.float32)
        hypers = tuple([base + dyn for base in self._hyper_base])
        per_param = tuple([hypers[i] for i in self._wd_index])
        return self.hyper_map(ops.partial(_cpu_adamw, self.cpu_kernels.adamw), self._parameters, self.moments1,
                              self.moments2, gradients, per_param)

    def construct(self, gradients, skip=None):
        weight_decay = self.get_weight_decay()
        lr = self.get_lr()
        beta1, beta2 = self.beta1, self.beta2
        if skip is None:
            self.assignadd(self.global_step, self.global_step_increase_tensor)
        else:
            keep = ops.logical_not(skip)
            self.assignadd(self.global_step, self.global_step_increase_tensor * ops.cast(keep, ms.int32))
            beta1 = ops.where(skip, self._one, beta1)
            beta2 = ops.where(skip, self._one, beta2)
            scale = ops.cast(keep, ms.float32)
            if self.is_group_lr:
                lr = tuple(x * scale for x in lr)
            else:
                lr = lr * scale
            gradients = self.hyper_map(ops.partial(_zero_if, skip), gradients)
        states = (self._parameters, self.moments1, self.moments2, gradients, self.decay_flags, self.optim_filter)
        if self.use_fused_opt:
            if self.is_group and self.is_group_lr:
                result = self.hyper_map(ops.partial(_fused_adam_weight_decay, self.fused_opt, beta1, beta2, self.eps),
                                        lr, weight_decay, *states)
            elif self.is_group:
                result = self.hyper_map(ops.partial(_fused_adam_weight_decay, self.fused_opt, beta1, beta2, self.eps,
                                                    lr), weight_decay, *states)
            else:
                result = self.hyper_map(ops.partial(_fused_adam_weight_decay, self.fused_opt, beta1, beta2, self.eps,
                                                    lr, weight_decay), *states)
        elif self.is_group and self.is_group_lr:
            result = self.hyper_map(ops.partial(_adam_opt, beta1, beta2, self.eps), lr, weight_decay, *states)
        elif self.is_group:
            result = self.hyper_map(ops.partial(_adam_opt, beta1, beta2, self.eps, lr), weight_decay, *states)
        else:
            result = self.hyper_map(ops.partial(_adam_opt, beta1, beta2, self.eps, lr, weight_decay), *states)
        if self.use_parallel:
            self.broadcast_params(result)
        return result


__all__ = ["AdamW", "float32_states"]
