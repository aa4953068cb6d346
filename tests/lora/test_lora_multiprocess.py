"""A LoRA fine-tune through scripts/run_distribute.sh on 2 CPU ranks (data parallel), the way users
run it: ``run_mode: finetune``, ``load_checkpoint`` = the base model, ``pet_config`` from the
command line. Ranks end with identical adapters; checkpoints hold adapters and their optimizer
state only, the base file is untouched; a SIGKILL of one rank then ``--resume_training=True`` ends
bit-identical to the uninterrupted run; resuming with another base is refused.

Needs the trainer wiring of msllm.lora (apply_lora after loading the base, adapter-only
checkpoints with the base identity, adapter resume); see docs/lora.md."""

import os
import random
import signal

import numpy as np
import pytest

from helpers import TINY_YAML
from helpers.distributed import (kill_rank, rank_log, run_two_ranks, start_two_ranks, successful_run, two_rank_table,
                                 wait_for)
from helpers.distributed import train_summary as summary
from lora_helpers import SEED, build, save_base

pytestmark = pytest.mark.slow

STEPS = 12
SHAPE = ["--model.model_config.seq_length=64", "--model.model_config.hidden_size=64",
         "--model.model_config.num_layers=2", "--model.model_config.num_heads=2",
         "--model.model_config.n_kv_heads=1"]
LORA = ["--run_mode=finetune", "--model.model_config.pet_config.pet_type=lora",
        "--model.model_config.pet_config.lora_rank=4", "--model.model_config.pet_config.lora_alpha=8",
        "--model.model_config.pet_config.lora_dropout=0.0",
        "--model.model_config.pet_config.target_modules=.*wq|.*wk|.*wv|.*wo",
        "--runner_config.batch_size=2", f"--runner_config.train_steps={STEPS}",
        "--callbacks.checkpoint.save_checkpoint_steps=3", "--callbacks.checkpoint.keep_checkpoint_max=10",
        "--callbacks.loss_monitor.per_print_times=1", "--deterministic=True", "--lr_schedule.warmup_ratio=0.2",
        "--lr_schedule.learning_rate=5e-3"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, alpaca_mindrecord):
    from msllm.config import load_config
    from msllm.convert.starting import base_identity

    d = tmp_path_factory.mktemp("lora_dp")
    table = two_rank_table(d)
    mc = load_config(TINY_YAML, SHAPE).model_config
    base = save_base(build(mc, seed=SEED), str(d / "base.ckpt"))
    other = save_base(build(mc, seed=SEED + 1), str(d / "other_base.ckpt"))
    return {"data": alpaca_mindrecord, "table": table, "base": base, "other": other,
            "base_sha": base_identity(base)["sha256"]}


def launch(setup, out, extra=(), wait=True, base=None):
    args = [f"--train_dataset_dir={setup['data']}", f"--load_checkpoint={base or setup['base']}", *SHAPE, *LORA,
            *extra]
    if wait:
        return run_two_ranks(setup["table"], TINY_YAML, "finetune", out, args, timeout=900)
    return start_two_ranks(setup["table"], TINY_YAML, "finetune", out, args)


def checkpoints(out, rank):
    from msllm.training import checkpoint as ckpt

    return ckpt.list_checkpoints(str(out / "checkpoint" / f"rank_{rank}"))


def entries(path):
    import mindspore as ms

    return {k: v.asnumpy() for k, v in ms.load_checkpoint(path).items()}


@pytest.fixture(scope="module")
def uninterrupted(setup, tmp_path_factory):
    return successful_run(tmp_path_factory.mktemp("lora_a") / "out", lambda out: launch(setup, out))


def test_lora_data_parallel_ranks_hold_identical_adapters_only(setup, uninterrupted):
    from msllm.formats.manifest import read_sidecar
    from msllm.convert.starting import base_identity
    from msllm.lora.targets import is_adapter_param

    out = uninterrupted
    assert summary(out, 0)["steps"] == summary(out, 1)["steps"] == STEPS
    assert summary(out, 0)["losses"][0] != summary(out, 1)["losses"][0]  # different data per rank
    assert "LoRA:" in rank_log(out, 0) and "trainable of" in rank_log(out, 0)
    last0, last1 = checkpoints(out, 0)[-1], checkpoints(out, 1)[-1]
    a, b = entries(last0), entries(last1)
    adapters = sorted(k for k in a if is_adapter_param(k))
    assert len(adapters) == 2 * 4 * 2  # 2 layers x q/k/v/o x (A, B)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # adapters and their AdamW moments, step counters; no base weight
    weights = [k for k in a if not is_adapter_param(k) and not k.startswith(("adam_m.", "adam_v."))]
    assert not [k for k in weights if k.endswith(".weight") or k.endswith("embedding_table")], weights
    assert sorted(k for k in a if k.startswith("adam_m.")) == [f"adam_m.{k}" for k in adapters]
    manifest = read_sidecar(last0)
    assert manifest["lora"]["base"]["sha256"] == setup["base_sha"]
    assert base_identity(setup["base"])["sha256"] == setup["base_sha"]  # the base file is untouched


def test_lora_sigkill_then_resume_matches_uninterrupted(setup, uninterrupted, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    seed = int(os.environ.get("MSLLM_TEST_SEED", "20261122"))
    kill_at = random.Random(seed).randint(4, 6)  # after the step-3 checkpoint, from a printed seed
    print(f"seed {seed}: SIGKILL at step {kill_at}")
    print("kill at step", kill_at)
    p = launch(setup, out, wait=False)
    assert wait_for(lambda: f"step:[{kill_at:5d}/" in rank_log(out, 1), 600, p), rank_log(out, 1)[-2000:]
    kill_rank(out, 1, signal.SIGKILL)
    p.communicate(timeout=300)
    assert p.returncode != 0  # killed before the end
    rc, text = launch(setup, out, ["--resume_training=True"])
    assert rc == 0, text[-3000:]
    for rank in (0, 1):
        s, ref = summary(out, rank), summary(uninterrupted, rank)
        start = s["start_step"]
        assert start in (3, 6, 9)  # the newest checkpoint complete on both ranks when the kill landed
        assert s["losses"] == ref["losses"][start:], f"rank {rank}"
        last, ref_last = checkpoints(out, rank)[-1], checkpoints(uninterrupted, rank)[-1]
        assert os.path.basename(last) == os.path.basename(ref_last)
        a, b = entries(last), entries(ref_last)
        assert a.keys() == b.keys()
        for k in b:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_lora_resume_with_another_base_is_refused(setup, uninterrupted, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    rc, text = launch(setup, out, ["--resume_training=True"], base=setup["other"])
    assert rc != 0
    assert "SHA-256" in text + rank_log(out, 0) and "other_base.ckpt" in text + rank_log(out, 0)
