"""Mixture of experts (msllm/models/llama/moe.py) beyond the family tables' parity tests
(tests/helpers/families.py feeds the MoE cases through conversion, training, generation): the
released shapes' total and active parameter counts against transformers' own models of their
config.json (built on the meta device), the run YAMLs, and the settings not built yet refused."""

import os
import subprocess
import sys

import numpy as np
from helpers.tables import training_tables
import pytest

from msllm.config import load_config
from msllm.convert.configs import msllm_config_to_hf
from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig, MoeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch = pytest.importorskip("torch")

# (run YAML, total, active): Mixtral-8x7B "46.7B total, 12.9B active" (Mistral AI's release),
# Qwen3-30B-A3B "30.5B total, 3.3B activated" (Qwen3 technical report, table 1)
RELEASED = {"mixtral_8x7b": ("configs/mixtral/run_mixtral_8x7b.yaml", 46.7e9, 12.9e9),
            "qwen3_30b_a3b": ("configs/qwen3_moe/run_qwen3_30b_a3b.yaml", 30.5e9, 3.3e9)}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_moe_shapes_count_like_transformers(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    path, total, active = RELEASED[name]
    mc = load_config(os.path.join(ROOT, path)).model_config
    hf = msllm_config_to_hf(mc)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    assert mc.num_params() == sum(p.numel() for p in model.parameters())
    # the releases quote 0.1B, rounded (Mixtral active 12.88B -> 12.9B) or cut (Qwen3 active 3.353B -> 3.3B)
    assert abs(mc.num_params() - total) < 0.06e9 and abs(mc.active_params() - active) < 0.06e9
    print(name, "total", mc.num_params(), "active", mc.active_params())
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", os.path.join(ROOT, path),
                        "--show"], capture_output=True, text=True, timeout=300, env=dict(os.environ, GLOG_v="3"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"active parameters {mc.active_params():,}" in r.stdout and f"parameters: {mc.num_params():,}" in r.stdout


def test_flops_per_token_count_the_active_experts():
    dense = LlamaConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, seq_length=16)
    moe = LlamaConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, seq_length=16,
                      model_type="mixtral", moe_config=MoeConfig(expert_num=8, num_experts_chosen=2))
    # two experts of the dense MLP's size per token, plus the (8, 32) router, per layer
    assert moe.matmul_params() == dense.matmul_params() + 2 * (3 * 48 * 32 + 8 * 32)
    assert moe.train_flops_per_token() - dense.train_flops_per_token() == 6 * 2 * (3 * 48 * 32 + 8 * 32)
    assert moe.num_params() - moe.active_params() == 2 * 6 * 3 * 48 * 32
    # HFU counts what the dense-over-experts dispatch runs: every expert's three matmuls, forward and backward
    from msllm.config import RunConfig
    from msllm.training.throughput import throughput_for_run

    cfg = RunConfig()
    cfg.model.model_config = moe
    run = throughput_for_run(cfg, 1.0)
    assert run.flops_per_token == moe.train_flops_per_token()
    assert run.executed_flops_per_token(1.0) == pytest.approx(moe.train_flops_per_token() + 6 * 2 * 6 * 3 * 48 * 32)
    # the grouped dispatch (CPU kernels) runs the k routed experts only: HFU's count is the model's
    grouped = throughput_for_run(cfg, 1.0, grouped_experts=True)
    assert grouped.executed_flops_per_token(1.0) == pytest.approx(moe.train_flops_per_token())


@pytest.mark.parametrize("kw, message", [
    (dict(capacity_factor=-1.0), "capacity_factor must be >= 0"),
    (dict(num_experts_chosen=9), "1 <= num_experts_chosen <= expert_num"),
])
def test_moe_settings_not_built_are_refused(kw, message):
    with pytest.raises(MsllmError, match=message):
        LlamaConfig(hidden_size=32, num_layers=1, num_heads=4, seq_length=16, moe_config=MoeConfig(**kw))


def test_expert_parallel_layout_rules_and_refusals():
    """expert_parallel divides data_parallel (MindFormers' rule) and expert_num; experts' widths
    divide by model_parallel; no pipeline stages with experts; a dense model has nothing to split;
    on CPU one message says expert parallelism needs Ascend's all-to-all."""
    from msllm.cluster.context import check_device_support
    from msllm.config import ParallelLayoutConfig, RunConfig
    from msllm.parallel.layout_checks import validate_layout

    mc = LlamaConfig(hidden_size=32, num_layers=2, num_heads=4, seq_length=16, intermediate_size=48,
                     moe_config=MoeConfig(expert_num=4, moe_intermediate_size=16))
    validate_layout(mc, ParallelLayoutConfig(data_parallel=2, model_parallel=2, expert_parallel=2))
    cases = [
        (mc, dict(data_parallel=8, expert_parallel=8), "expert_num=4 is not divisible by parallel_config.expert_parallel=8"),
        (mc, dict(model_parallel=32), "moe_intermediate_size (each expert's width)=16 is not divisible"),
        (mc, dict(pipeline_stage=2, micro_batch_num=2), "pipeline-parallel mixture of experts is not implemented"),
        (LlamaConfig(hidden_size=32, num_layers=2, num_heads=4, seq_length=16), dict(data_parallel=2, expert_parallel=2),
         "without model.model_config.moe_config"),
    ]
    for model, kw, message in cases:
        with pytest.raises(MsllmError, match=message.replace("(", r"\(").replace(")", r"\)")):
            validate_layout(model, ParallelLayoutConfig(**kw))
    with pytest.raises(MsllmError, match="must divide data_parallel"):
        ParallelLayoutConfig(data_parallel=3, expert_parallel=2).validate("parallel_config")
    cfg = RunConfig()
    cfg.model.model_config = mc
    cfg.parallel_config = ParallelLayoutConfig(data_parallel=2, expert_parallel=2)
    with pytest.raises(MsllmError, match="no AlltoAll kernel on CPU"):
        check_device_support(cfg)


def _np_swiglu(x, gate_up, down):
    """numpy SwiGLU of one fused expert: x (M, C), gate_up (2I, C), down (C, I)."""
    i = down.shape[1]
    h = x @ gate_up.T
    g, u = h[:, :i], h[:, i:]
    return (g / (1 + np.exp(-g)) * u) @ down.T


def _capacity_reference(x, w_router, gate_up, down, k, norm, capacity):
    """The capacity dispatch by hand: choices queue choice-major then in token order, each
    expert keeps its first ``capacity``; returns (out (N, C), dropped count, counts (E,))."""
    n, e = x.shape[0], w_router.shape[0]
    z = x @ w_router.T
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, -1, kind="stable")[:, :k]
    top = np.take_along_axis(p, idx, -1)
    if norm:
        top = top / top.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    taken = np.zeros(e, int)
    dropped = 0
    for j in range(k):                 # every token's first choice before any second choice
        for t in range(n):
            ex = idx[t, j]
            if taken[ex] < capacity:
                taken[ex] += 1
                out[t] += top[t, j] * _np_swiglu(x[t:t + 1], gate_up[ex], down[ex])[0]
            else:
                dropped += 1
    return out, dropped, np.bincount(idx.ravel(), minlength=e)


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_dispatch_drops_the_choices_counted_by_hand(factor):
    """Training with capacity_factor: the layer's output equals the hand-written dispatch (first
    choices queue first), its dropped count equals the count by hand, and the model's logged
    stats give that count as a fraction and each expert's share; evaluation drops nothing."""
    import mindspore as ms

    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.models.llama.moe import expert_capacity

    ms.set_device("CPU")   # before any kernel runs (later tests set it too)
    seed = 20261126
    print("seed", seed)
    ms.set_seed(seed)
    mc = LlamaConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, seq_length=12, model_type="mixtral",
                     moe_config=MoeConfig(expert_num=4, num_experts_chosen=2, moe_intermediate_size=8,
                                          capacity_factor=factor, aux_loss_factor=0.01))
    net = LlamaForCausalLM(mc)
    moe = net.model.layers[0].mlp
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, 16)).astype(np.float32)
    w_router = rng.standard_normal((4, 16)).astype(np.float32)     # a sharp router: uneven loads
    moe.gate.weight.set_data(ms.Tensor(w_router))
    gate_up, down = moe.experts.gate_up_proj.asnumpy(), moe.experts.down_proj.asnumpy()
    cap = expert_capacity(24, 2, factor, 4)
    assert cap == int(np.ceil(2 * 24 * factor / 4))
    ref, dropped, counts = _capacity_reference(x, w_router, gate_up, down, 2, True, cap)
    assert dropped == sum(max(0, c - cap) for c in counts) > 0
    moe.set_train(True)
    out, got_counts, _, got_dropped = moe(ms.Tensor(x))
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=1e-5, atol=1e-6)
    assert float(got_dropped.asnumpy()) == dropped
    np.testing.assert_array_equal(got_counts.asnumpy(), counts)
    moe.set_train(False)                                             # inference: dropless
    full, _, _, none = moe(ms.Tensor(x))
    dense, zero, _ = _capacity_reference(x, w_router, gate_up, down, 2, True, 24)
    assert float(none.asnumpy()) == 0 and zero == 0
    np.testing.assert_allclose(full.asnumpy(), dense, rtol=1e-5, atol=1e-6)
    # the model's stats: [aux loss, dropped fraction, each expert's share of the choices]
    net.return_router_stats(True)
    net.set_train(True)
    ids = ms.Tensor(rng.integers(0, 64, (2, 13)).astype(np.int32))
    loss, stats = net(ids, ids)
    h = net.model.embed(ids[:, :-1])
    layer = net.model.layers[0]
    normed = layer.post_attention_layernorm(h + layer.self_attn(layer.input_layernorm(h),
                                                               *training_tables(net.config, 12)))
    moe.set_train(True)   # a sub-cell called on its own keeps its own compile phase (GRAPH_MODE)
    _, c2, _, d2 = moe(normed.reshape(24, 16))
    stats = stats.asnumpy()
    assert stats[1] == pytest.approx(float(d2.asnumpy()) / (24 * 2)) and stats[1] > 0
    np.testing.assert_allclose(stats[2:], c2.asnumpy() / 48, rtol=1e-6)


def test_hfu_counts_the_capacity_buffer_rows():
    """With a capacity factor the experts run E x capacity rows per micro batch of N tokens:
    HFU counts 6 x 3 I C per row per MoE layer, MFU the k routed experts per token."""
    from msllm.config import RunConfig
    from msllm.training.throughput import throughput_for_run

    mc = LlamaConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, seq_length=16,
                     model_type="mixtral", moe_config=MoeConfig(expert_num=8, num_experts_chosen=2, capacity_factor=0.5))
    cfg = RunConfig()
    cfg.model.model_config = mc
    cfg.runner_config.batch_size = 2
    run = throughput_for_run(cfg, 1.0)
    n = 32                               # tokens of the micro batch; capacity ceil(2 * 32 * 0.5 / 8) = 4
    rows = 8 * 4
    assert run.executed_flops_per_token(1.0) - run.flops_per_token == pytest.approx(
        2 * 6 * 3 * 48 * 32 * (rows / n - 2))
