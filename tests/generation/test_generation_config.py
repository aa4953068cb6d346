"""Decoding settings: precedence (command line > generation_config > MindFormers' keys in
model.model_config > Hugging Face defaults), length rules, and one clear error per bad value."""

import os

import pytest
import yaml

from gentest_helpers import TINY_YAML
from msllm.config import load_config
from msllm.errors import MsllmError
from msllm.config_generation import DEFAULT_MAX_NEW_TOKENS, GenerationConfig, resolve_settings


def write_yaml(tmp_path, model_keys=None, gen_keys=None):
    data = yaml.safe_load(open(TINY_YAML))
    data["model"]["model_config"].update(model_keys or {})
    if gen_keys is not None:
        data["generation_config"] = gen_keys
    path = os.path.join(tmp_path, "run.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(data, fh)
    return path


def test_hf_defaults_and_model_ids():
    cfg = load_config(TINY_YAML)
    s = resolve_settings(cfg.generation_config, cfg.model_config, seed=cfg.seed, batch_size=4)
    assert (s.do_sample, s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.num_beams, s.length_penalty,
            s.early_stopping) == (False, 1.0, 50, 1.0, 1.0, 1, 1.0, False)
    assert (s.max_new_tokens, s.eos_token_id, s.pad_token_id, s.use_past, s.batch_size) == (
        DEFAULT_MAX_NEW_TOKENS, (2,), 0, True, 4)


def test_precedence_cli_over_yaml_over_mindformers_keys(tmp_path):
    path = write_yaml(tmp_path, model_keys=dict(do_sample=True, top_k=7, top_p=0.5, repetition_penalty=1.3,
                                                max_decode_length=40, use_past=False),
                      gen_keys=dict(top_k=9, temperature=0.7))
    cfg = load_config(path)
    s = resolve_settings(cfg.generation_config, cfg.model_config)
    assert (s.do_sample, s.top_k, s.top_p, s.repetition_penalty, s.temperature, s.use_past) == (
        True, 9, 0.5, 1.3, 0.7, False)
    assert s.max_new_tokens is None and s.max_length == 40          # MindFormers' total length
    assert s.new_tokens(prompt_length=15, context=256) == 25
    cfg = load_config(path, ["--generation_config.top_k=3", "--generation_config.max_new_tokens=5",
                             "--generation_config.eos_token_id=[2, 7]", "--generation_config.use_past=True"])
    s = resolve_settings(cfg.generation_config, cfg.model_config)
    assert (s.top_k, s.max_new_tokens, s.max_length, s.eos_token_id, s.use_past) == (3, 5, None, (2, 7), True)


def test_length_is_capped_by_the_context_window():
    s = resolve_settings(GenerationConfig(max_new_tokens=100))
    assert s.new_tokens(prompt_length=10, context=64) == 54
    with pytest.raises(MsllmError, match="context window"):
        s.new_tokens(prompt_length=64, context=64)
    with pytest.raises(MsllmError, match="max_length=10 leaves no new token"):
        resolve_settings(GenerationConfig(max_length=10)).new_tokens(prompt_length=12, context=64)


@pytest.mark.parametrize("override, message", [
    ("top_p=1.5", "top_p=1.5: expected a value in \\(0, 1\\]"),
    ("top_p=0", "top_p=0.0: expected a value in \\(0, 1\\]"),
    ("num_beams=0", "num_beams=0: expected >= 1"),
    ("top_k=-1", "top_k=-1: expected >= 0"),
    ("max_new_tokens=0", "max_new_tokens=0: expected >= 1"),
    ("repetition_penalty=0", "repetition_penalty=0.0: expected > 0"),
    ("early_stopping=sometimes", "early_stopping='sometimes'"),
])
def test_bad_values_are_refused_at_config_load(override, message):
    with pytest.raises(MsllmError, match=message):
        load_config(TINY_YAML, [f"--generation_config.{override}"])


def test_rules_that_need_the_resolved_settings(tmp_path):
    with pytest.raises(MsllmError, match="temperature=0.0: expected > 0 with do_sample"):
        resolve_settings(GenerationConfig(do_sample=True, temperature=0.0))
    # do_sample from model_config (moved into generation_config when read): refused at load already
    with pytest.raises(MsllmError, match="generation_config.temperature=0.0"):
        load_config(write_yaml(tmp_path, model_keys=dict(do_sample=True)), ["--generation_config.temperature=0"])
    with pytest.raises(MsllmError, match="beam sampling"):
        resolve_settings(GenerationConfig(num_beams=2, do_sample=True))
    with pytest.raises(MsllmError, match="eos_token_id=40000: outside the model's vocabulary"):
        resolve_settings(GenerationConfig(eos_token_id=40000), load_config(TINY_YAML).model_config)
