"""Memory planner: terms against independent counts, the activation formula's structure
(Korthikanti et al. 2022), recompute, optimizer sharding, pipelining, suggestions, the CLI."""

import os
import subprocess
import sys

import pytest

from msllm.config import RunConfig, load_config
from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig, preset
from msllm.parallel.planner import layer_activation_bytes, parse_memory, plan, suggest_layouts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 1 << 30


def cfg_for(mc, **pc):
    cfg = RunConfig()
    cfg.model.model_config = mc
    for k, v in pc.items():
        setattr(cfg.parallel_config, k, v)
    cfg.parallel.enable_parallel_optimizer = cfg.parallel_config.optimizer_shard
    if cfg.parallel_config.model_parallel > 1 or cfg.parallel_config.pipeline_stage > 1:
        cfg.parallel.parallel_mode = 1
    return cfg


def test_parse_memory():
    assert parse_memory("64GB") == 64 * GiB == parse_memory("64 GiB") == parse_memory(64 * GiB)
    assert parse_memory("512MB") == 512 << 20 and parse_memory("1.5G") == 3 * GiB // 2
    with pytest.raises(MsllmError, match="expected a size such as 64GB"):
        parse_memory("64 parsecs")


def test_single_device_fp32_terms_are_16_bytes_per_parameter():
    mc = preset("7b")                                 # fp32 compute: no weight copies
    p = plan(cfg_for(mc))
    st = p["stages"][0]
    n = mc.num_params()
    assert st["weights"] == 4 * n and st["gradients"] == 4 * n and st["optimizer_states"] == 8 * n
    assert st["weight_copies"] == 0 and st["grad_accumulation"] == 0
    assert p["total"] == st["total"] == sum(st[k] for k in ("weights", "weight_copies", "gradients",
                                                             "grad_accumulation", "optimizer_states",
                                                             "activations", "head_and_loss", "constants"))


def test_optimizer_shard_divides_weights_grads_and_states_by_dp():
    mc = preset("7b")
    n = mc.num_params()
    norms = (2 * mc.num_layers + 1) * mc.hidden_size      # never optimizer-sharded
    st = plan(cfg_for(mc, data_parallel=8, optimizer_shard=True))["stages"][0]
    assert st["optimizer_states"] == 8 * ((n - norms) // 8 + norms)
    assert st["weights"] == st["gradients"] == 4 * ((n - norms) // 8 + norms)
    assert st["weight_copies"] == 4 * (n - norms)         # the all-gathered fp32 slices (no recompute)
    off = plan(cfg_for(mc, data_parallel=8))["stages"][0]
    assert off["optimizer_states"] == 8 * n               # plain data parallel: full replicas


def test_activation_formula_structure():
    # fp16 everywhere, f = 4h: s b h (12/t_sp + 48/t) + 2 a s^2 b / t  (module docstring)
    mc = LlamaConfig(hidden_size=1024, num_heads=16, num_layers=2, intermediate_size=4096, seq_length=2048,
                     compute_dtype="float16", layernorm_compute_type="float16", softmax_compute_type="float16",
                     param_init_type="float16")
    s, b, h, a = 2048, 2, 1024, 16
    for t in (1, 2, 8):
        got = layer_activation_bytes(mc, b, tp=t)["stored"]
        assert got == pytest.approx(s * b * h * (12 + 48 / t) + 2 * a * s * s * b / t)
        sp = layer_activation_bytes(mc, b, tp=t, seq_parallel=True)["stored"]
        assert sp == pytest.approx(layer_activation_bytes(mc, b)["stored"] / t)   # Korthikanti eq. 3: all / t
    assert layer_activation_bytes(mc, b, recompute="full")["stored"] == 2 * s * b * h       # eq. 4: 2sbh
    full = layer_activation_bytes(mc, b)["stored"]
    select = layer_activation_bytes(mc, b, recompute="select")["stored"]
    assert full - select == pytest.approx(2 * a * s * s * b + 3 * 2 * s * b * 4096)
    # fp32 softmax of a bf16 model stores the fp32 probabilities and their bf16 copy
    bf = LlamaConfig(hidden_size=1024, num_heads=16, num_layers=2, intermediate_size=4096, seq_length=2048,
                     compute_dtype="bfloat16")
    assert layer_activation_bytes(bf, 1)["stored"] == pytest.approx(
        2048 * 1024 * (2 * (4 + 2) + 2 * 2 + 4 * 2) + 5 * 2 * 2048 * 4096 + 16 * 2048 * 2048 * (4 + 2))


def test_recompute_and_pipeline_in_flight_micro_batches():
    cfg = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_70b.yaml"))
    p = plan(cfg, parse_memory("64GB"))
    stages = p["stages"]
    assert [s["micro_batches_in_flight"] for s in stages] == [4, 3, 2, 1]     # 1F1B: p - i
    assert [s["layers"] for s in stages] == [20, 20, 20, 20]
    # the 70B config sets use_flash_attention: the layer being recomputed keeps no scores
    full_layer = layer_activation_bytes(cfg.model_config, 1, tp=8, recompute="full", flash_attention=True)
    for s in stages:
        assert s["activations"] == pytest.approx(20 * full_layer["stored"] * s["micro_batches_in_flight"]
                                                 + full_layer["full"])
    assert p["worst_stage"] == 0 and p["fits"] and stages[3]["head_and_loss"] > 0 == stages[0]["head_and_loss"]
    none = plan(cfg, recompute="none")
    # 9.45x with flash attention's small statistics (17.7x with the (B, a, s, s) scores)
    assert none["stages"][0]["activations"] > 9 * stages[0]["activations"]


def test_suggestions_fit_and_use_the_same_device_count():
    cfg = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_13b.yaml"))
    mem = parse_memory("32GB")
    assert not plan(cfg, mem)["fits"]
    found = suggest_layouts(cfg, mem, limit=50)
    assert found
    for s in found:
        assert s["data_parallel"] * s["model_parallel"] * s["pipeline_stage"] == 16
        assert s["total"] <= mem and s["model_parallel"] <= 8
        assert cfg.model_config.num_heads % s["model_parallel"] == 0
    order = [("none", "select", "full").index(s["recompute"]) for s in found]
    assert order == sorted(order)


def test_plan_memory_tool():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_memory.py"), "--config",
                        os.path.join(ROOT, "configs", "llama", "run_llama_7b.yaml"), "--device_memory", "64GB",
                        "--suggest", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "stage 0 (32 layers, 1 mb)" in r.stdout and "-> fits" in r.stdout
    assert "layouts of 8 devices that fit" in r.stdout
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_memory.py"), "--config",
                        os.path.join(ROOT, "configs", "llama", "run_llama_70b.yaml"), "--device_memory", "lots"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "error: device memory 'lots'" in r.stderr


def test_flash_attention_replaces_the_scores_term():
    # FlashAttentionScore keeps softmax_max and softmax_sum, (B, a, s, 8) fp32 each, instead of the
    # (B, a, s, s) probabilities: hand-computed for bf16, s 2048, b 1, a 16, h 1024, f 4096
    bf = LlamaConfig(hidden_size=1024, num_heads=16, num_layers=2, intermediate_size=4096, seq_length=2048,
                     compute_dtype="bfloat16")
    n_tokens = 2048
    without_scores = 2048 * 1024 * (2 * (4 + 2) + 2 * 2 + 4 * 2) + 5 * 2 * 2048 * 4096
    assert layer_activation_bytes(bf, 1, flash_attention=True)["stored"] == pytest.approx(
        without_scores + 2 * 16 * n_tokens * 8 * 4)
    for t in (2, 8):
        assert layer_activation_bytes(bf, 1, tp=t, flash_attention=True)["stored"] == pytest.approx(
            2048 * 1024 * (2 * (4 + 2) + 2 * 2) + (2048 * 1024 * 4 * 2 + 5 * 2 * 2048 * 4096 + 2 * 16 * 2048 * 32) / t)
    # the 7B config (use_flash_attention: True, bf16, head_dim 128) plans with it, and the same
    # config with use_flash_attention: False needs the (B, a, s, s) term on top
    cfg = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_7b.yaml"))
    assert cfg.model_config.use_flash_attention is True
    with_fa = plan(cfg, recompute="none")["stages"][0]
    cfg.model_config.use_flash_attention = False
    without = plan(cfg, recompute="none")["stages"][0]
    mc, b, tp = cfg.model_config, cfg.runner_config.batch_size, cfg.parallel_config.model_parallel
    a, sq = mc.num_heads, mc.seq_length
    extra_per_layer = (a * sq * sq * b * (4 + 2) - 64 * a * sq * b) / tp
    assert without["activations"] - with_fa["activations"] == pytest.approx(without["layers"] * extra_per_layer)


def test_family_switches_in_the_activation_and_parameter_terms():
    """Qwen3-like head_dim 128 at hidden 64 x 4 heads (H*D = 512 != C), q/k norms, GeGLU: the stored
    activations per layer counted by hand; the weights term follows the one table of shapes
    (biases and q/k norm weights included: 16 bytes per parameter in fp32 with AdamW)."""
    base = dict(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=96,
                seq_length=32)
    plain = LlamaConfig(**base)
    fam = LlamaConfig(**base, head_dim=128, qk_norm=True, qkv_has_bias=True, hidden_act="gelu_pytorch_tanh")
    n_tok, e = 32 * 2, 4
    p, f = layer_activation_bytes(plain, 2)["stored"], layer_activation_bytes(fam, 2)["stored"]
    # heads 4 x 64 -> 4 x 128 wide (4 tensors), q/k norms (4 + 2) x 128 in and out, one ffn tensor fewer
    assert f - p == n_tok * (4 * (512 - 64) * e + (512 + 256) * (4 + 4) - 96 * e)
    cfg = RunConfig()
    cfg.model.model_config = fam
    assert plan(cfg)["stages"][0]["weights"] + plan(cfg)["stages"][0]["optimizer_states"] + \
        plan(cfg)["stages"][0]["gradients"] == 16 * fam.num_params()


def test_experts_in_the_weight_and_activation_terms():
    """Mixture of experts: with expert_parallel 2 each rank stores half of the experts (weights,
    gradients, AdamW moments: 16 bytes per stored fp32 parameter); a sparse layer's activations,
    counted by hand, replace the dense MLP's five f-wide tensors by the router's fp32
    probabilities and weights, and the experts' rows: E x N dropless, E x capacity with a
    capacity factor (training)."""
    from msllm.models.llama.config import MoeConfig

    moe = MoeConfig(expert_num=4, num_experts_chosen=2, moe_intermediate_size=40)
    mc = LlamaConfig(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=96,
                     seq_length=32, model_type="mixtral", moe_config=moe)
    experts = mc.num_layers * 4 * 3 * 40 * 64
    terms = plan(cfg_for(mc, data_parallel=2, expert_parallel=2))["stages"][0]
    assert terms["weights"] + terms["gradients"] + terms["optimizer_states"] == 16 * (mc.num_params() - experts // 2)
    n_tok, e, h = 32 * 2, 4, 64
    dense = layer_activation_bytes(mc, 2)["stored"]
    sparse = layer_activation_bytes(mc, 2, moe_layer=True)["stored"]
    rows = 4 * n_tok
    assert sparse - dense == 8 * n_tok * 4 + 2 * e * rows * h + 5 * e * rows * 40 - 5 * e * n_tok * 96
    capped = LlamaConfig(**{**mc.__dict__, "moe_config": MoeConfig(expert_num=4, num_experts_chosen=2,
                                                                    moe_intermediate_size=40, capacity_factor=1.0)})
    rows_c = 4 * 32      # capacity ceil(2 * 64 * 1.0 / 4) = 32 rows per expert
    assert layer_activation_bytes(capped, 2, moe_layer=True)["stored"] - sparse == \
        (rows_c - rows) * (2 * e * h + 5 * e * 40)
    # every layer is sparse here: the plan's activations are two sparse layers
    run = cfg_for(mc)
    run.runner_config.batch_size = 2
    assert plan(run)["stages"][0]["activations"] == pytest.approx(2 * sparse)


def test_lora_base_is_frozen_and_copied_per_pipeline_call():
    """LoRA (rank 8 on wq, wv): only the adapters have gradients, accumulators and AdamW moments
    (float32); under pipeline stages each frozen weight is counted once more, the TensorMove copy
    MindSpore's pipeline makes of it (its memory tracker on a compiled tiny rank, docs/dryrun.md).
    Hand count: each adapter pair is A (8, 128) + B (out, 8), out = 128 for wq and 64 for wv
    (2 kv heads x 32)."""
    from msllm.config_lora import PetConfig
    from msllm.lora.layout import lora_plan_inputs

    mc = preset("tiny")
    cfg = cfg_for(mc)
    cfg.pet_config = PetConfig(lora_rank=8, lora_alpha=16, target_modules=".*wq|.*wv")
    layouts, trainable = lora_plan_inputs(cfg)
    full = plan(cfg_for(mc))["stages"][0]
    lora = plan(cfg, layouts=layouts, trainable=trainable)["stages"][0]
    adapters = mc.num_layers * (8 * 128 + 128 * 8 + 8 * 128 + 64 * 8)
    assert lora["gradients"] == 4 * adapters and lora["optimizer_states"] == 8 * adapters
    assert lora["weights"] == full["weights"] + 4 * adapters
    piped = cfg_for(mc, pipeline_stage=2, micro_batch_num=2)
    piped.pet_config = cfg.pet_config
    layouts, trainable = lora_plan_inputs(piped)
    stages = plan(piped, layouts=layouts, trainable=trainable)["stages"]
    frozen = sum(s["weights"] for s in stages) - 4 * adapters
    assert sum(s["weight_copies"] for s in stages) == frozen and sum(s["grad_accumulation"] for s in stages) == 4 * adapters
