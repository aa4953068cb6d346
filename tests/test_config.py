"""Config schema: YAML -> typed dataclasses, overrides, rejection of bad keys and types."""

import os

import pytest
import yaml

from msllm.cli_args import split_overrides
from msllm.config import RunConfig, load_config, save_config, to_dict
from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig, llama_intermediate_size, preset

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "llama")


@pytest.mark.parametrize("name,expected_b", [("7b", 6.74), ("13b", 13.0), ("70b", 69.0)])
def test_shipped_configs_match_published_llama2_sizes(name, expected_b):
    cfg = load_config(os.path.join(CONFIGS, f"run_llama_{name}.yaml"))
    assert abs(cfg.model_config.num_params() / 1e9 - expected_b) / expected_b < 0.01


def test_llama2_intermediate_sizes_follow_meta_rounding():
    assert llama_intermediate_size(4096, 256, None) == 11008
    assert llama_intermediate_size(5120, 256, None) == 13824
    assert llama_intermediate_size(8192, 4096, 1.3) == 28672


def test_tiny_config_is_small_and_cpu_ready():
    cfg = load_config(os.path.join(CONFIGS, "run_llama_tiny.yaml"))
    mc = cfg.model_config
    assert 1e6 < mc.num_params() < 2e7
    assert mc.vocab_size == 32000 and mc.seq_length <= 256
    assert cfg.context.device_target == "CPU" and mc.compute_dtype == "float32"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(os.path.join(CONFIGS, "run_llama_tiny.yaml"), ["--runner_config.batch_size=3"])
    path = tmp_path / "resolved.yaml"
    save_config(cfg, str(path))
    again = load_config(str(path))
    assert to_dict(again) == to_dict(cfg)
    assert again.runner_config.batch_size == 3


def write(tmp_path, data):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_unknown_key_names_path_and_suggests(tmp_path):
    path = write(tmp_path, {"runner_config": {"batchsize": 2}})
    with pytest.raises(MsllmError, match=r"runner_config\.batchsize.*did you mean 'batch_size'"):
        load_config(path)


def test_unknown_nested_model_key(tmp_path):
    path = write(tmp_path, {"model": {"model_config": {"num_layer": 2}}})
    with pytest.raises(MsllmError, match=r"model\.model_config\.num_layer.*num_layers"):
        load_config(path)


@pytest.mark.parametrize("section,key,value,expect", [
    ("runner_config", "batch_size", "four", "expected an integer"),
    ("runner_config", "sink_mode", 1, "expected true/false"),
    ("optimizer", "weight_decay", "lots", "expected a number"),
    ("context", "device_target", 3, "expected a string"),
])
def test_wrong_types_are_rejected_with_key_path(tmp_path, section, key, value, expect):
    path = write(tmp_path, {section: {key: value}})
    with pytest.raises(MsllmError, match=rf"{section}\.{key}: {expect}"):
        load_config(path)


def test_bad_values_are_rejected(tmp_path):
    with pytest.raises(MsllmError, match="num_heads"):
        load_config(write(tmp_path, {"model": {"model_config": {"hidden_size": 100, "num_heads": 3}}}))
    with pytest.raises(MsllmError, match="n_kv_heads"):
        load_config(write(tmp_path, {"model": {"model_config": {"num_heads": 8, "n_kv_heads": 3,
                                                                 "hidden_size": 64}}}))
    with pytest.raises(MsllmError, match="run_mode"):
        load_config(write(tmp_path, {"run_mode": "fly"}))
    with pytest.raises(MsllmError, match="jit_level"):
        load_config(write(tmp_path, {"context": {"jit_level": "O9"}}))


def test_yaml_1_1_exponent_strings_are_numbers(tmp_path):
    # PyYAML reads "1e-5" (no dot) as a string; a float field must still accept it.
    p = tmp_path / "c.yaml"
    p.write_text("lr_schedule:\n  learning_rate: 1e-5\n")
    assert load_config(str(p)).lr_schedule.learning_rate == 1e-5


def test_missing_and_invalid_yaml_files(tmp_path):
    with pytest.raises(MsllmError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    p = tmp_path / "bad.yaml"
    p.write_text("a: [1, 2\n")
    with pytest.raises(MsllmError, match="not valid YAML at line"):
        load_config(str(p))


def test_overrides_both_forms_and_aliases():
    assert split_overrides(["--a.b", "1", "--c=x", "--train_dataset_dir", "d"]) == [
        "--a.b=1", "--c=x", "--train_dataset.dataset_dir=d"]
    with pytest.raises(MsllmError, match="no value"):
        split_overrides(["--a.b"])


def test_override_sets_nested_values():
    cfg = load_config(os.path.join(CONFIGS, "run_llama_tiny.yaml"),
                      ["--model.model_config.num_layers=2", "--optimizer.betas=[0.8, 0.9]"])
    assert cfg.model_config.num_layers == 2
    assert cfg.optimizer.betas == [0.8, 0.9]


def test_run_config_defaults_are_valid():
    RunConfig().validate()
    assert LlamaConfig().num_params() == preset("7b").num_params()
