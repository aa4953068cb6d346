"""The mixture-of-experts MLP of the LLaMA family (Mixtral, Qwen3-MoE, Qwen2-MoE), in its own
module beside the model file.

Routing as transformers 5.24 (``models/mixtral/modeling_mixtral.py`` ``MixtralTopKRouter``,
``models/qwen2_moe/modeling_qwen2_moe.py`` ``Qwen2MoeTopKRouter`` / ``Qwen2MoeSparseMoeBlock``):
router logits ``x W_r^T`` (bias-free, W_r (E, C)), softmax in float32, the top k, renormalised to
sum 1 when ``norm_topk_prob``; each chosen expert is a SwiGLU MLP whose gate and up rows are
stored fused, ``gate_up_proj`` (E, 2I, C) (rows 0..I-1 the gate, I..2I-1 the up projection) and
``down_proj`` (E, C, I); the token's output is the weighted sum of its k experts' outputs, plus,
in Qwen2-MoE, a shared SwiGLU expert scaled by ``sigmoid(x w_g)`` (w_g (1, C)).

Dispatch: this first implementation is **dropless and dense over the experts**: every expert
runs on every token and the combine weights are zero outside each token's top k, which gives
exactly the routed result but costs E / k times the routed FLOPs (a small-E fallback; the
static-shape grouped dispatch whose cost grows with k, not E, is not built yet). Inference,
evaluation and training all drop no token.

Load balancing (Switch Transformer, Fedus et al. 2021, eq. 4-6, as transformers'
``load_balancing_loss_func``): each MoE layer returns, for its N tokens, the top-k assignment
count per expert (E,) and the summed router probabilities per expert (E,); the model pools them
over its MoE layers (R = layers x N rows) and the loss is ``E * sum_e (count_e / R) (prob_e / R)``.

Shapes: N tokens, C hidden, E experts, k chosen, I expert width, S shared-expert width.
"""

from __future__ import annotations

from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer

import mindspore as ms


class Experts(nn.Cell):
    """E SwiGLU experts stored fused: ``gate_up_proj`` (E, 2I, C), ``down_proj`` (E, C, I).

    ``construct(x (N, C), weights (N, E))`` -> (N, C) float: ``sum_e weights[:, e] * expert_e(x)``
    (dense over the experts; weights are zero for experts a token did not choose)."""

    def __init__(self, config, dtype, compute_dtype):
        super().__init__()
        e, c, i = config.moe_config.expert_num, config.hidden_size, config.expert_size
        std = config.initializer_range
        self.gate_up_proj = Parameter(initializer(Normal(std), (e, 2 * i, c), dtype), name="gate_up_proj")
        self.down_proj = Parameter(initializer(Normal(std), (e, c, i), dtype), name="down_proj")
        self.n_experts, self.width = e, i
        self.compute_dtype = compute_dtype
        self.bmm_gate_up = ops.BatchMatMul(transpose_b=True)
        self.bmm_down = ops.BatchMatMul(transpose_b=True)
        self.sigmoid = ops.Sigmoid()
        self.mul_silu = ops.Mul()
        self.mul = ops.Mul()
        self.mul_weights = ops.Mul()
        self.cast = ops.Cast()

    def construct(self, x, weights):
        n, c = x.shape
        e, i = self.n_experts, self.width
        xe = ops.broadcast_to(ops.expand_dims(self.cast(x, self.compute_dtype), 0), (e, n, c))     # (E, N, C)
        h = self.bmm_gate_up(xe, self.cast(self.gate_up_proj, self.compute_dtype))                # (E, N, 2I)
        gate, up = h[:, :, :i], h[:, :, i:]
        act = self.mul(self.mul_silu(gate, self.sigmoid(gate)), up)                                # (E, N, I)
        y = self.bmm_down(act, self.cast(self.down_proj, self.compute_dtype))                      # (E, N, C)
        w = ops.expand_dims(ops.transpose(self.cast(weights, y.dtype), (1, 0)), -1)                # (E, N, 1)
        return self.mul_weights(y, w).sum(0)                                                       # (N, C)


class SparseMoE(nn.Cell):
    """The MoE MLP of one decoder layer: router ``gate`` (E, C), ``experts``, and with a shared
    expert width S > 0 ``shared_expert`` (a SwiGLU MLP) and ``shared_expert_gate`` (1, C).

    ``construct(x (N, C))`` -> (out (N, C), counts (E,) float32 top-k assignments per expert (no
    gradient), probs (E,) float32 summed router probabilities per expert).

    ``make_linear(in, out)`` / ``make_mlp(width)``: the model's own Linear and SwiGLU cells (so the
    router and the shared expert run on the same kernels as the dense layers)."""

    def __init__(self, config, make_linear, make_mlp, param_dtype, compute_dtype):
        super().__init__()
        m = config.moe_config
        c = config.hidden_size
        self.n_experts, self.top_k, self.norm_topk = m.expert_num, m.num_experts_chosen, m.norm_topk_prob
        self.gate = make_linear(c, m.expert_num)
        self.experts = Experts(config, param_dtype, compute_dtype)
        self.shared_expert = self.shared_expert_gate = None
        if m.shared_expert_intermediate_size:
            self.shared_expert = make_mlp(m.shared_expert_intermediate_size)
            self.shared_expert_gate = make_linear(c, 1)
        self.softmax = ops.Softmax(-1)
        self.topk = ops.TopK(sorted=True)
        self.one_hot = ops.OneHot()
        self.on, self.off = ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32)
        self.cast = ops.Cast()
        self.sigmoid = ops.Sigmoid()
        self.mul_shared = ops.Mul()
        self.add_shared = ops.Add()

    def route(self, x):
        """x (N, C) -> (combine weights (N, E) float32, zero outside each token's top k;
        counts (E,); probs (E,))."""
        logits = self.cast(self.gate(x), ms.float32)                                    # (N, E)
        probs = self.softmax(logits)
        top, idx = self.topk(probs, self.top_k)                                         # (N, k)
        if self.norm_topk:
            top = top / top.sum(-1, keepdims=True)
        chosen = self.one_hot(idx, self.n_experts, self.on, self.off)                   # (N, k, E)
        weights = (chosen * ops.expand_dims(top, -1)).sum(1)                            # (N, E)
        counts = ops.stop_gradient(chosen.sum((0, 1)))                                  # (E,)
        return weights, counts, probs.sum(0)

    def construct(self, x):
        weights, counts, probs = self.route(x)
        out = self.experts(x, weights)                                                  # (N, C)
        if self.shared_expert is not None:
            gate = self.sigmoid(self.cast(self.shared_expert_gate(x), out.dtype))      # (N, 1)
            out = self.add_shared(out, self.mul_shared(gate, self.cast(self.shared_expert(x), out.dtype)))
        return out, counts, probs


def load_balancing_loss(counts, probs, rows: float, n_experts: int):
    """``E * sum_e (counts_e / R) * (probs_e / R)`` (transformers' ``load_balancing_loss_func``
    without an attention mask); counts / probs (E,) summed over the MoE layers, R = their rows."""
    return n_experts * ((counts / rows) * (probs / rows)).sum()


__all__ = ["Experts", "SparseMoE", "load_balancing_loss"]
