"""MindFormers' research-directory run YAMLs (Qwen2.5 and Llama-3.1 as its LlamaForCausalLM, dev
branch fd4deebc) through the compat layer: the keys they add to the r1.0 LLaMA configs map to the
family switches (qkv_has_bias -> Qwen2, extend_method LLAMA3 / YARN -> rotary scaling, a list
eos_token_id, generation temperature), or are listed with their reason, or refused naming the key.
The fixtures carry those files' keys with the released shapes; the parameter counts are the
released checkpoints' tensor sums."""

from __future__ import annotations

import os

import pytest

from msllm.compat.mindformers import translate_mindformers_yaml
from msllm.config import RunConfig, from_dict, load_config
from msllm.errors import MsllmError

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN = os.path.join(HERE, "fixtures", "mf_research_qwen2_5_7b_predict.yaml")
LLAMA31 = os.path.join(HERE, "fixtures", "mf_research_llama3_1_8b_predict.yaml")


def translate(model_config: dict, **top) -> tuple[RunConfig, list[str]]:
    data = {"model": {"model_config": {"type": "LlamaConfig", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                       "seq_length": 32, **model_config}, "arch": {"type": "LlamaForCausalLM"}},
            **top}
    out, notes = translate_mindformers_yaml(data, "run.yaml", RunConfig)
    cfg = from_dict(RunConfig, out)
    cfg.validate()
    return cfg, [path for path, _ in notes]


def test_qwen2_5_predict_yaml_is_a_qwen2_of_the_released_size():
    from msllm.convert.configs import msllm_config_to_hf

    cfg = load_config(QWEN)
    mc = cfg.model_config
    assert (mc.model_type, mc.qkv_has_bias, mc.attention_bias) == ("qwen2", True, False)
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.kv_heads, mc.ffn_size, mc.vocab_size) == \
        (3584, 28, 28, 4, 18944, 152064)
    assert mc.rope_theta == 1e6 and mc.rms_norm_eps == 1e-6
    assert mc.num_params() == 7_615_616_512
    assert mc.eos_token_id == 151645 and list(cfg.generation_config.eos_token_id) == [151645, 151643]
    assert cfg.generation_config.temperature == 0.7
    hf = msllm_config_to_hf(mc)      # a config.json transformers reads as Qwen2
    assert hf["model_type"] == "qwen2" and hf["num_key_value_heads"] == 4


def test_llama3_1_predict_yaml_has_the_llama3_rotary_scaling():
    mc = load_config(LLAMA31).model_config
    assert mc.rope_scaling == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}
    assert mc.max_position_embeddings == 131072 and mc.rope_theta == 500000
    assert mc.num_params() == 8_030_261_248


def test_research_keys_without_effect_are_listed():
    _, notes = translate({"emb_dropout_prob": 0.0, "rotary_pct": 1.0, "rotary_emb_base": 1000000,
                          "auto_map": {"AutoTokenizer": ["x.Tok", None]}},
                         load_ckpt_format="ckpt", parallel_config={"context_parallel": 1})
    for key in ("model.model_config.emb_dropout_prob", "model.model_config.rotary_pct",
                "model.model_config.rotary_emb_base", "model.model_config.auto_map", "load_ckpt_format",
                "parallel_config.context_parallel"):
        assert key in notes, key


def test_yarn_and_attention_bias_map():
    cfg, _ = translate({"extend_method": "YARN", "scaling_factor": {"factor": 4.0, "original_max_position_embeddings": 32,
                                                                    "beta_fast": 32.0, "beta_slow": 1.0}})
    assert cfg.model_config.rope_scaling == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                             "beta_fast": 32.0, "beta_slow": 1.0}
    cfg, _ = translate({"qkv_has_bias": True, "attn_proj_has_bias": True})
    mc = cfg.model_config
    assert (mc.model_type, mc.attention_bias, mc.qkv_has_bias) == ("llama", True, False)


def test_a_dynamic_loss_scale_with_factor_1_is_a_fixed_scale():
    cfg, notes = translate({}, runner_wrapper={"type": "MFTrainOneStepCell", "scale_sense": {
        "type": "DynamicLossScaleUpdateCell", "loss_scale_value": 4096, "scale_factor": 1, "scale_window": 100000}})
    assert (cfg.runner_wrapper.loss_scale, cfg.runner_wrapper.scale_sense) == ("fixed", 4096.0)
    assert "runner_wrapper.scale_sense.scale_factor" in notes


@pytest.mark.parametrize("model_config, top, message", [
    ({"extend_method": "PI", "scaling_factor": {"factor": 2.0}}, {}, "extend_method PI takes one number"),
    ({"extend_method": "LLAMA3", "scaling_factor": 8.0}, {}, "extend_method LLAMA3 needs a mapping"),
    ({"extend_method": "DYNAMIC_NTK", "scaling_factor": 2.0}, {}, "DYNAMIC_NTK has no formula"),
    ({"attn_proj_has_bias": True}, {}, "a bias on the output projection alone"),
    ({}, {"parallel_config": {"context_parallel": 2}}, "context (sequence) parallelism is not implemented"),
    ({}, {"load_ckpt_format": "npz"}, "load_ckpt_format"),
    # the research Qwen2.5 fine-tuning YAML's per-stage recompute and three-column data
    ({}, {"recompute_config": {"recompute": [7, 7]}}, "recomputing chosen layers per pipeline stage"),
    ({}, {"train_dataset": {"data_loader": {"type": "MindDataset", "dataset_dir": "/d"},
                            "input_columns": ["input_ids", "target_ids", "attention_mask"]}}, "input_columns"),
])
def test_research_values_msllm_cannot_honour_are_refused(model_config, top, message):
    with pytest.raises(MsllmError, match=message.replace("(", r"\(").replace(")", r"\)")):
        translate(model_config, **top)


def test_embedding_init_type_sets_the_embedding_dtype():
    import mindspore as ms

    from msllm.models.llama.config import LlamaConfig
    from msllm.models.llama.model import LlamaModel

    cfg, notes = translate({"embedding_init_type": "float16", "param_init_type": "float32", "compute_dtype": "float32",
                            "vocab_size": 50})
    assert cfg.model_config.embedding_init_type == "float16"
    assert "model.model_config.embedding_init_type" not in notes
    model = LlamaModel(LlamaConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, seq_length=8,
                                   embedding_init_type="float16"))
    assert model.embed_tokens.embedding_table.dtype == ms.float16
    assert model.layers[0].mlp.gate_proj.weight.dtype == ms.float32


def test_top_level_moe_config_moves_to_the_model_and_expert_parallel_is_read():
    cfg, _ = translate({"model_type": "mixtral"}, moe_config={"expert_num": 4, "num_experts_chosen": 2,
                                                              "capacity_factor": 1.25, "aux_loss_factor": 0.01},
                       parallel_config={"data_parallel": 2, "expert_parallel": 2})
    m = cfg.model_config.moe_config
    assert (m.expert_num, m.num_experts_chosen, m.capacity_factor, m.aux_loss_factor) == (4, 2, 1.25, 0.01)
    assert cfg.parallel_config.expert_parallel == 2
    with pytest.raises(MsllmError, match="routing_policy"):   # a MoEConfig key msllm has not: named
        translate({}, moe_config={"expert_num": 4, "routing_policy": "TopkRouterV2"})
