"""An absent key is not a disagreement (issue #30): MindFormers' own run_llama_13b.yaml, unchanged
(tests/compat/fixtures/mf_upstream_run_llama_13b.yaml), sets parallel.enable_parallel_optimizer
and has no parallel_config.optimizer_shard; it loads, and --only_save_strategy writes its 16 files.
A genuine disagreement (both keys given, different values) is still refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from msllm.config import load_config, was_given
from msllm.errors import MsllmError
from msllm.parallel.layout_checks import optimizer_shard_enabled, validate_run_layout

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
UPSTREAM_13B = os.path.join(HERE, "fixtures", "mf_upstream_run_llama_13b.yaml")
TINY = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")


def _yaml(tmp_path, data, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_upstream_13b_yaml_loads_with_its_optimizer_shard():
    raw = yaml.safe_load(open(UPSTREAM_13B))
    assert "optimizer_shard" not in raw["parallel_config"]  # the fixture really lacks the key
    cfg = load_config(UPSTREAM_13B)
    assert cfg.parallel.enable_parallel_optimizer is True
    assert cfg.parallel_config.optimizer_shard is True  # taken from the key the YAML gives
    assert optimizer_shard_enabled(cfg) is True
    assert validate_run_layout(cfg, 16) == [20, 20]  # 40 layers over pp2
    assert was_given(cfg, "parallel.enable_parallel_optimizer")
    assert not was_given(cfg, "parallel_config.optimizer_shard")


@pytest.mark.parametrize("given,key", [("parallel_config", "optimizer_shard"),
                                        ("parallel", "enable_parallel_optimizer")])
def test_either_spelling_alone_sets_both(tmp_path, given, key):
    data = yaml.safe_load(open(TINY))
    data.setdefault("parallel", {}).pop("enable_parallel_optimizer", None)
    data.setdefault("parallel_config", {}).pop("optimizer_shard", None)
    data["parallel"]["parallel_mode"] = 1
    data[given][key] = True
    cfg = load_config(_yaml(tmp_path, data))
    assert cfg.parallel.enable_parallel_optimizer is True and cfg.parallel_config.optimizer_shard is True


def test_an_override_of_one_spelling_sets_both(tmp_path):
    data = yaml.safe_load(open(TINY))
    data.setdefault("parallel", {}).pop("enable_parallel_optimizer", None)
    data.setdefault("parallel_config", {}).pop("optimizer_shard", None)
    cfg = load_config(_yaml(tmp_path, data), ["--parallel.enable_parallel_optimizer=True"])
    assert cfg.parallel_config.optimizer_shard is True


def test_both_given_and_different_is_still_refused(tmp_path):
    data = yaml.safe_load(open(UPSTREAM_13B))
    data["parallel_config"]["optimizer_shard"] = False
    cfg = load_config(_yaml(tmp_path, data))
    with pytest.raises(MsllmError, match="optimizer_shard=False disagrees with parallel.enable_parallel_optimizer=True"):
        optimizer_shard_enabled(cfg)


def test_dataset_batch_size_alone_is_the_runner_batch_size(tmp_path):
    """msllm's schema: train_dataset.batch_size given without runner_config.batch_size is the batch
    size, not a disagreement with runner_config's default of 1."""
    data = yaml.safe_load(open(TINY))
    data.setdefault("runner_config", {}).pop("batch_size", None)
    data["train_dataset"]["batch_size"] = 3
    cfg = load_config(_yaml(tmp_path, data))
    assert cfg.runner_config.batch_size == 3
    data["runner_config"]["batch_size"] = 2
    with pytest.raises(MsllmError, match="train_dataset.batch_size=3 disagrees"):
        load_config(_yaml(tmp_path, data, "d.yaml"))


def test_upstream_13b_only_save_strategy_writes_16_files(tmp_path):
    """The blog's strategy step on the unchanged MindFormers YAML (one process writes every rank)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", UPSTREAM_13B,
                           "--only_save_strategy", "True", "--output_dir", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(os.listdir(out / "strategy"))
    assert [f for f in files if f.startswith("ckpt_strategy_rank_")] == sorted(
        f"ckpt_strategy_rank_{r}.ckpt" for r in range(16))
