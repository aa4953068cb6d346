"""run_msllm.py takes run_mindformer.py's flags (issue #12): dataset and device flags map to their
config keys, --use_parallel must agree with the launch, and MindFormers keys accepted without
effect are the ones the start-up line names."""

import os
import subprocess
import sys

import yaml

from msllm.config import load_config
from msllm.settings import check_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")
MF_FIXTURE = os.path.join(ROOT, "tests", "compat", "fixtures", "mf_blog_llama_7b_finetune.yaml")


def run(args, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("MS_WORKER_NUM", "RANK_SIZE", "RANK_ID")}
    environ.update(env)
    return subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), *args], capture_output=True,
                          text=True, timeout=300, env=environ)


def test_mindformers_flags_set_their_config_keys():
    r = run(["--config", TINY, "--print_config", "--train_dataset", "/data/train", "--eval_dataset", "/data/eval",
             "--device_id", "3", "--device_target", "CPU", "--run_mode", "finetune",
             "--src_strategy_path_or_dir", "/s", "--auto_trans_ckpt", "True", "--resume_training", "False",
             "--load_checkpoint", "/ckpt", "--only_save_strategy", "False", "--use_parallel", "False"])
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["train_dataset"]["dataset_dir"] == "/data/train" and cfg["eval_dataset"]["dataset_dir"] == "/data/eval"
    assert cfg["context"]["device_id"] == 3 and cfg["run_mode"] == "finetune" and cfg["load_checkpoint"] == "/ckpt"
    assert cfg["src_strategy_path_or_dir"] == "/s" and cfg["auto_trans_ckpt"] is True


def test_use_parallel_must_agree_with_the_launch():
    alone = run(["--config", TINY, "--show", "--use_parallel", "True"])
    assert alone.returncode == 2 and "started alone" in alone.stderr and "Traceback" not in alone.stderr
    launched = run(["--config", TINY, "--show", "--use_parallel", "False"], MS_WORKER_NUM="2")
    assert launched.returncode == 2 and "started 2 ranks" in launched.stderr
    assert run(["--config", TINY, "--show", "--use_parallel", "True"], MS_WORKER_NUM="2").returncode == 0
    bad = run(["--config", TINY, "--show", "--use_parallel", "maybe"])
    assert bad.returncode == 2 and "expected True or False" in bad.stderr


def test_every_mindformers_key_without_effect_is_in_the_start_up_notes():
    cfg = load_config(MF_FIXTURE, [])  # MindFormers' 13B YAML unchanged (fp16, FP32StateAdamWeightDecay)
    assert cfg.ignored_keys, "the fixture has MindFormers keys msllm does not use"
    notes = check_settings(cfg, "finetune")
    for key in cfg.ignored_keys:
        assert key in notes
    # and the schema's own device notes come with them (sink_mode: True is MindFormers' default)
    assert any(n.startswith("runner_config.sink_mode=True") for n in notes) == cfg.runner_config.sink_mode
