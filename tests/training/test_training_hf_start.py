"""Training from a Hugging Face directory: its config.json decides the model, the run YAML supplies
only what config.json lacks, and a YAML value config.json overrides is named (one start-up line)."""

import dataclasses

from helpers import TINY_YAML
from msllm.config import load_config
from msllm.models.llama.config import HF_FIELDS, LlamaConfig, merge_run_config
from msllm.training.sources import adopt_hf_model_config


def test_config_json_decides_the_model_and_conflicts_are_named(smollm2_dir, caplog):
    import logging

    # the tiny YAML sets vocab_size 32000, hidden 128, 4 layers ...: all overridden by config.json
    cfg = load_config(TINY_YAML, [f"--load_checkpoint={smollm2_dir}", "--model.model_config.seq_length=96"])
    with caplog.at_level(logging.INFO, logger="msllm"):
        out = adopt_hf_model_config(cfg)
    mc = out.model_config
    assert (mc.vocab_size, mc.hidden_size, mc.num_layers, mc.num_heads, mc.kv_heads, mc.ffn_size) == \
        (49152, 576, 30, 9, 3, 1536)
    assert mc.tie_word_embeddings and mc.rope_theta == 100000.0 and mc.rms_norm_eps == 1e-5
    assert mc.seq_length == 96                                     # from the YAML: config.json has none
    assert mc.pad_token_id == cfg.model_config.pad_token_id        # the data's padding, from the YAML
    notes = [r.getMessage() for r in caplog.records if "have no effect" in r.getMessage()]
    assert len(notes) == 1
    # (a YAML value equal to LlamaConfig's default, like vocab_size 32000, cannot be told from an unset one;
    # the model line names what is used)
    assert "hidden_size=128 (config.json: 576)" in notes[0] and "num_layers=4 (config.json: 30)" in notes[0]
    assert any("vocab 49152" in r.getMessage() for r in caplog.records)


def test_merge_keeps_run_keys_and_cuts_seq_length_to_the_positions():
    hf = LlamaConfig(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=96,
                     max_position_embeddings=128, seq_length=128, rope_theta=5e5, tie_word_embeddings=True)
    run = dataclasses.replace(LlamaConfig(), seq_length=256, compute_dtype="float16", cpu_kernels=False)
    merged, conflicts = merge_run_config(hf, run)
    assert all(getattr(merged, k) == getattr(hf, k) for k in HF_FIELDS)
    assert merged.compute_dtype == "float16" and merged.cpu_kernels is False
    assert merged.seq_length == 128 and conflicts == ["seq_length=256 (the model's max_position_embeddings: 128)"]
