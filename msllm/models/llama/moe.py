"""The mixture-of-experts MLP of the LLaMA family (Mixtral, Qwen3-MoE, Qwen2-MoE), in its own
module beside the model file.

Routing as transformers 5.24 (``models/mixtral/modeling_mixtral.py`` ``MixtralTopKRouter``,
``models/qwen2_moe/modeling_qwen2_moe.py`` ``Qwen2MoeTopKRouter`` / ``Qwen2MoeSparseMoeBlock``):
router logits ``x W_r^T`` (bias-free, W_r (E, C)), softmax in float32, the top k, renormalised to
sum 1 when ``norm_topk_prob``; each chosen expert is a SwiGLU MLP whose gate and up rows are
stored fused, ``gate_up_proj`` (E, 2I, C) (rows 0..I-1 the gate, I..2I-1 the up projection) and
``down_proj`` (E, C, I); the token's output is the weighted sum of its k experts' outputs, plus,
in Qwen2-MoE, a shared SwiGLU expert scaled by ``sigmoid(x w_g)`` (w_g (1, C)).

Dispatch, three ways (static shapes all):

* **dropless, grouped** (msllm's CPU kernels; inference, evaluation, and training with
  ``capacity_factor`` 0): the k N token choices are sorted by expert (a counting sort: each
  choice's place is its expert's start plus its rank among that expert's choices, so the order is
  deterministic), the rows gathered, and each expert's SwiGLU runs on its own rows with one GEMM
  per expert (``grouped_linear``, ``msllm/kernels/csrc/grouped.cc``, as MindSpore's GroupedMatmul
  on Ascend); the outputs are gathered back, weighted and summed per token. Cost: k N rows,
  whatever E is.
* **dropless, dense over the experts** (without the CPU kernels: the layout path, Ascend, or
  a CPU without a compiler): every expert runs on every token and the combine weights are zero
  outside each token's top k. Exactly the routed result, at E / k times the routed FLOPs: the
  small-E fallback.
* **capacity** (training with ``capacity_factor`` > 0, MindFormers' ``moe_config.capacity_factor``):
  each expert takes at most ``capacity = ceil(k * N * capacity_factor / E)`` (at most N) of the
  k * N token choices, as MindFormers' ``calculate_expert_capacity``
  (``mindformers/modules/transformer/moe.py``). Choices queue choice-major (every token's first
  choice before any second choice, then in token order: GShard / Switch priority), a choice past
  its expert's capacity is dropped (its weight's share of the output is lost; the residual path
  carries the token), and the experts run on an (E, capacity, C) buffer gathered from the tokens:
  cost k * capacity_factor times a dense MLP's, whatever E is.

Load balancing (Switch Transformer, Fedus et al. 2021, eq. 4-6, as transformers'
``load_balancing_loss_func``): each MoE layer returns, for its N tokens, the top-k assignment
count per expert (E,) and the summed router probabilities per expert (E,); the model pools them
over its MoE layers (R = layers x N rows) and the loss is ``E * sum_e (count_e / R) (prob_e / R)``.
Under data parallelism the counts may be summed over the ranks first ("global-batch" balancing,
Qiu et al. 2025, "Demons in the Detail", arXiv:2501.11873): the mean of the ranks' losses and
gradients is then exactly the whole batch's (``LlamaForCausalLM.set_router_count_reducer``).

Shapes: N tokens, C hidden, E experts, k chosen, I expert width, S shared-expert width.
"""

from __future__ import annotations

from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer

import mindspore as ms


def expert_capacity(tokens: int, top_k: int, capacity_factor: float, n_experts: int) -> int:
    """Token choices one expert takes per step: ``ceil(k * N * capacity_factor / E)``, at most N
    (MindFormers' ``calculate_expert_capacity`` / ``_v2``). Python ints: N is a static shape."""
    q = top_k * tokens * capacity_factor / n_experts
    cap = int(q)
    cap = cap + 1 if cap < q else cap
    return max(1, min(cap, tokens))


def queue_places(onehot):
    """(R, E) float32 one-hot expert of each of R choices -> (R,) float32: each choice's place
    among its expert's choices, in row order (0, 1, ...): the counting sort of both dispatches."""
    return (ops.cumsum(onehot, 0) * onehot).sum(-1) - 1.0


class Experts(nn.Cell):
    """E SwiGLU experts stored fused: ``gate_up_proj`` (E, 2I, C), ``down_proj`` (E, C, I).

    ``construct(x (N, C), weights (N, E))`` -> (N, C) float: ``sum_e weights[:, e] * expert_e(x)``
    (dense over the experts; weights are zero for experts a token did not choose).
    ``with_capacity(x, top, idx, chosen, capacity)``: the capacity dispatch; ``grouped(x, top,
    chosen)``: the dropless grouped dispatch on ``kernels`` (:class:`msllm.kernels.ops.CpuKernels`;
    module docstring). ``chosen`` is the router's (N, k, E) float32 one-hot of ``idx``."""

    def __init__(self, config, dtype, compute_dtype, kernels=None):
        super().__init__()
        self.kernels = kernels
        e, c, i = config.moe_config.expert_num, config.hidden_size, config.expert_size
        std = config.initializer_range
        self.gate_up_proj = Parameter(initializer(Normal(std), (e, 2 * i, c), dtype), name="gate_up_proj")
        self.down_proj = Parameter(initializer(Normal(std), (e, c, i), dtype), name="down_proj")
        self.n_experts, self.width = e, i
        self.compute_dtype = compute_dtype
        self.bmm_gate_up = ops.BatchMatMul(transpose_b=True)
        self.bmm_down = ops.BatchMatMul(transpose_b=True)
        self.split_gate_up = ops.Split(axis=2, output_num=2)
        self.sigmoid = ops.Sigmoid()
        self.mul_silu = ops.Mul()
        self.mul = ops.Mul()
        self.mul_weights = ops.Mul()
        self.cast = ops.Cast()
        # the dense dispatch's own primitives, so that the layout table can shard each one
        # (msllm/parallel/layout_rules.py _moe): a functional call gets MindSpore's default strategy
        self.expand_x = ops.ExpandDims()
        self.broadcast_x = ops.BroadcastTo((e, -1, -1))
        self.cast_x = ops.Cast()
        self.cast_w = ops.Cast()
        self.transpose_w = ops.Transpose()
        self.expand_w = ops.ExpandDims()
        self.sum_experts = ops.ReduceSum()
        self.scatter = ops.ScatterNd()
        self.gather_rows = ops.Gather()
        self.concat_rows = ops.Concat(0)

    def mlp(self, xe):
        """xe (E, M, C) -> (E, M, C): expert e's SwiGLU on its M rows."""
        h = self.bmm_gate_up(self.cast_x(xe, self.compute_dtype),
                             self.cast(self.gate_up_proj, self.compute_dtype))             # (E, M, 2I)
        gate, up = self.split_gate_up(h)                                                   # (E, M, I) each
        act = self.mul(self.mul_silu(gate, self.sigmoid(gate)), up)                        # (E, M, I)
        return self.bmm_down(act, self.cast(self.down_proj, self.compute_dtype))           # (E, M, C)

    def construct(self, x, weights):
        xe = self.broadcast_x(self.expand_x(x, 0))                                           # (E, N, C)
        y = self.mlp(xe)                                                                     # (E, N, C)
        w = self.expand_w(self.transpose_w(self.cast_w(weights, y.dtype), (1, 0)), -1)       # (E, N, 1)
        return self.sum_experts(self.mul_weights(y, w), 0)                                   # (N, C)

    def grouped(self, x, top, chosen):
        """x (N, C), top (N, k) float32 weights of the chosen experts, chosen (N, k, E) their
        one-hot -> (N, C): every choice computed, one GEMM per expert over its rows (CPU kernels)."""
        n, c = x.shape
        k = top.shape[1]
        e, i = self.n_experts, self.width
        onehot = ops.reshape(chosen, (n * k, e))                                     # (kN, E) row t*k+j
        counts = onehot.sum(0)                                                       # (E,)
        ends = ops.cumsum(counts, 0)
        rank = queue_places(onehot)                                                  # (kN,) among its expert's
        dest = ops.stop_gradient(self.cast((onehot * (ends - counts)).sum(-1) + rank, ms.int32))  # sorted row
        offsets = ops.stop_gradient(self.concat_rows((ops.zeros((1,), ms.float32), ends)))        # (E+1,)
        tok = ops.floor_divide(ops.arange(0, n * k, dtype=ms.int32), k)             # (kN,) token of each choice
        src = ops.stop_gradient(self.scatter(ops.expand_dims(dest, -1), tok, (n * k,)))  # sorted row -> token
        xs = self.gather_rows(self.cast(x, ms.float32), src, 0)                      # (kN, C) by expert
        h = self.kernels.grouped_linear(xs, self.gate_up_proj, offsets)              # (kN, 2I)
        act = self.kernels.swiglu(h[:, :i], h[:, i:])                                # (kN, I)
        ys = self.kernels.grouped_linear(act, self.down_proj, offsets)               # (kN, C)
        w = ops.reshape(top, (n * k, 1))
        y = self.mul_weights(self.gather_rows(ys, dest, 0), w)                       # (kN, C) choice order
        return ops.reshape(y, (n, k, c)).sum(1)                                      # (N, C)

    def with_capacity(self, x, top, idx, chosen, capacity: int):
        """x (N, C), top (N, k) float32 weights of the chosen experts idx (N, k) int32, chosen
        (N, k, E) their one-hot -> (out (N, C), dropped: float32 scalar count of the k * N choices
        past their expert's ``capacity``)."""
        n, c = x.shape
        k = top.shape[1]
        e = self.n_experts
        flat_e = ops.reshape(ops.transpose(idx, (1, 0)), (k * n,))                   # (kN,) choice-major
        onehot = ops.reshape(ops.transpose(chosen, (1, 0, 2)), (k * n, e))           # (kN, E) the same order
        pos = self.cast(queue_places(onehot), ms.int32)                              # (kN,) place in its queue
        keep = pos < capacity
        dummy = e * capacity                                                          # one zero row past the buffer
        slot = ops.stop_gradient(ops.where(keep, flat_e * capacity + pos, dummy))    # (kN,)
        tok = ops.tile(ops.arange(0, n, dtype=ms.int32), (k,))                       # (kN,) token of each choice
        filled = self.scatter(ops.expand_dims(slot, -1), ops.where(keep, tok + 1, 0), (dummy + 1,))
        src = filled[:dummy] - 1                                                      # (E*cap,) token, -1 empty
        src = ops.stop_gradient(ops.where(src < 0, n, src))                          # empty -> the zero row N
        zero = ops.zeros((1, c), x.dtype)
        xe = ops.reshape(self.gather_rows(self.concat_rows((x, zero)), src, 0), (e, capacity, c))
        y = ops.reshape(self.mlp(xe), (e * capacity, c))                             # (E*cap, C)
        y = self.concat_rows((y, ops.zeros((1, c), y.dtype)))                        # (E*cap + 1, C)
        w = ops.reshape(ops.transpose(self.cast(top, y.dtype), (1, 0)), (k * n, 1))  # (kN, 1)
        out = ops.reshape(self.mul_weights(self.gather_rows(y, slot, 0), w), (k, n, c)).sum(0)  # (N, C)
        dropped = ops.stop_gradient(float(k * n) - self.cast(keep, ms.float32).sum())
        return out, dropped


class SparseMoE(nn.Cell):
    """The MoE MLP of one decoder layer: router ``gate`` (E, C), ``experts``, and with a shared
    expert width S > 0 ``shared_expert`` (a SwiGLU MLP) and ``shared_expert_gate`` (1, C).

    ``construct(x (N, C))`` -> (out (N, C), counts (E,) float32 top-k assignments per expert (no
    gradient), probs (E,) float32 summed router probabilities per expert, dropped () float32 token
    choices dropped by the capacity (0 unless training with ``capacity_factor`` > 0)).

    ``make_linear(in, out)`` / ``make_mlp(width)``: the model's own Linear and SwiGLU cells (so the
    router and the shared expert run on the same kernels as the dense layers); ``kernels``: msllm's
    CPU kernels, which select the grouped dropless dispatch."""

    def __init__(self, config, make_linear, make_mlp, param_dtype, compute_dtype, kernels=None):
        super().__init__()
        m = config.moe_config
        c = config.hidden_size
        self.n_experts, self.top_k, self.norm_topk = m.expert_num, m.num_experts_chosen, m.norm_topk_prob
        self.capacity_factor = float(m.capacity_factor)
        self.gate = make_linear(c, m.expert_num)
        self.experts = Experts(config, param_dtype, compute_dtype, kernels)
        self.grouped = kernels is not None
        self.shared_expert = self.shared_expert_gate = None
        if m.shared_expert_intermediate_size:
            self.shared_expert = make_mlp(m.shared_expert_intermediate_size)
            self.shared_expert_gate = make_linear(c, 1)
        self.softmax = ops.Softmax(-1)
        self.topk = ops.TopK(sorted=True)
        self.one_hot = ops.OneHot()
        self.on, self.off = ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32)
        self.no_drop = ms.Tensor(0.0, ms.float32)
        self.cast = ops.Cast()
        self.sigmoid = ops.Sigmoid()
        self.mul_shared = ops.Mul()
        self.add_shared = ops.Add()

    def route(self, x):
        """x (N, C) -> (top (N, k) float32 weights of the chosen experts, idx (N, k) int32 the
        chosen experts (descending weight), chosen (N, k, E) float32 their one-hot (every dispatch
        reads it), counts (E,) (no gradient), probs (E,))."""
        logits = self.cast(self.gate(x), ms.float32)                                    # (N, E)
        probs = self.softmax(logits)
        top, idx = self.topk(probs, self.top_k)                                         # (N, k)
        if self.norm_topk:
            top = top / top.sum(-1, keepdims=True)
        chosen = self.one_hot(idx, self.n_experts, self.on, self.off)                   # (N, k, E)
        counts = ops.stop_gradient(chosen.sum((0, 1)))                                  # (E,)
        return top, idx, chosen, counts, probs.sum(0)

    def combine_weights(self, top, chosen):
        """(N, k) weights and their (N, k, E) one-hot -> (N, E) float32, zero outside each token's top k."""
        return (chosen * ops.expand_dims(top, -1)).sum(1)

    def construct(self, x):
        top, idx, chosen, counts, probs = self.route(x)
        if self.training and self.capacity_factor > 0:
            cap = expert_capacity(x.shape[0], self.top_k, self.capacity_factor, self.n_experts)
            out, dropped = self.experts.with_capacity(x, top, idx, chosen, cap)         # (N, C), ()
        elif self.grouped:
            out, dropped = self.experts.grouped(x, top, chosen), self.no_drop
        else:
            out, dropped = self.experts(x, self.combine_weights(top, chosen)), self.no_drop
        if self.shared_expert is not None:
            gate = self.sigmoid(self.cast(self.shared_expert_gate(x), out.dtype))      # (N, 1)
            out = self.add_shared(out, self.mul_shared(gate, self.cast(self.shared_expert(x), out.dtype)))
        return out, counts, probs, dropped


def load_balancing_loss(counts, probs, count_rows: float, prob_rows: float, n_experts: int):
    """``E * sum_e (counts_e / R_c) * (probs_e / R_p)``: transformers' ``load_balancing_loss_func``
    (without an attention mask) when R_c = R_p = the rows of every MoE layer; counts / probs (E,)
    summed over the MoE layers. Global-batch balancing passes counts summed over the
    data-parallel ranks with R_c their rows."""
    return n_experts * ((counts / count_rows) * (probs / prob_rows)).sum()


__all__ = ["Experts", "SparseMoE", "expert_capacity", "load_balancing_loss", "queue_places"]
