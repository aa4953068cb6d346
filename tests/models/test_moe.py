"""Mixture of experts (msllm/models/llama/moe.py) beyond the family tables' parity tests
(tests/helpers/families.py feeds the MoE cases through conversion, training, generation): the
released shapes' total and active parameter counts against transformers' own models of their
config.json (built on the meta device), the run YAMLs, and the settings not built yet refused."""

import os
import subprocess
import sys

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


@pytest.mark.parametrize("kw, message", [
    (dict(capacity_factor=1.25), "capacity_factor=1.25: token dropping is not implemented yet"),
    (dict(num_experts_chosen=9), "1 <= num_experts_chosen <= expert_num"),
])
def test_moe_settings_not_built_are_refused(kw, message):
    with pytest.raises(MsllmError, match=message):
        LlamaConfig(hidden_size=32, num_layers=1, num_heads=4, seq_length=16, moe_config=MoeConfig(**kw))


def test_moe_layouts_beyond_data_parallel_are_refused():
    from msllm.config import ParallelLayoutConfig
    from msllm.parallel.layout_checks import validate_layout

    mc = LlamaConfig(hidden_size=32, num_layers=2, num_heads=4, seq_length=16, moe_config=MoeConfig(expert_num=4))
    validate_layout(mc, ParallelLayoutConfig(data_parallel=2))
    with pytest.raises(MsllmError, match="mixture-of-experts layouts other than data parallel"):
        validate_layout(mc, ParallelLayoutConfig(model_parallel=2))
