"""Real multi-process data-parallel training through scripts/run_distribute.sh on CPU:
ranks end with identical parameters; a SIGKILLed or SIGTERMed run resumes and ends exactly where
the uninterrupted run ends (deterministic mode, bit-exact)."""

import os
import random
import signal
import time

import numpy as np
import pytest

from helpers import TINY_YAML
from helpers.distributed import (kill_rank, rank_log, run_two_ranks, start_two_ranks, successful_run, two_rank_table,
                                 wait_for)
from helpers.distributed import train_summary as summary
from msllm.training import checkpoint as ckpt

pytestmark = pytest.mark.slow

STEPS = 10
SMALL = ["--model.model_config.seq_length=64", "--model.model_config.hidden_size=64",
         "--model.model_config.num_layers=2", "--model.model_config.num_heads=2",
         "--model.model_config.n_kv_heads=1", "--runner_config.batch_size=2",
         f"--runner_config.train_steps={STEPS}", "--callbacks.checkpoint.save_checkpoint_steps=3",
         "--callbacks.checkpoint.keep_checkpoint_max=10", "--callbacks.loss_monitor.per_print_times=1",
         "--deterministic=True", "--lr_schedule.warmup_ratio=0.2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, alpaca_mindrecord):
    return {"data": alpaca_mindrecord, "table": two_rank_table(tmp_path_factory.mktemp("dp"))}


def launch(setup, out, extra=(), wait=True):
    args = [f"--train_dataset_dir={setup['data']}", *SMALL, *extra]
    if wait:
        return run_two_ranks(setup["table"], TINY_YAML, "train", out, args, timeout=600)
    return start_two_ranks(setup["table"], TINY_YAML, "train", out, args)


def params_of(path):
    return {k: v.asnumpy() for k, v in ckpt.load_params(path).items()
            if not k.startswith(("epoch_num", "step_num"))}


@pytest.fixture(scope="module")
def uninterrupted(setup, tmp_path_factory):
    return successful_run(tmp_path_factory.mktemp("a") / "out", lambda out: launch(setup, out))


def test_data_parallel_ranks_end_with_identical_parameters(uninterrupted):
    out = uninterrupted
    s0, s1 = summary(out, 0), summary(out, 1)
    assert s0["steps"] == s1["steps"] == STEPS and s0["world_size"] == 2
    # the ranks read different data ...
    assert s0["losses"][0] != s1["losses"][0]
    # ... yet hold the same parameters and optimizer state after every update
    p0 = params_of(ckpt.list_checkpoints(str(out / "checkpoint" / "rank_0"))[-1])
    p1 = params_of(ckpt.list_checkpoints(str(out / "checkpoint" / "rank_1"))[-1])
    assert p0.keys() == p1.keys()
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)


def test_deterministic_runs_are_bit_identical(setup, uninterrupted, tmp_path):
    out = successful_run(tmp_path / "out", lambda out: launch(setup, out))
    for rank in (0, 1):
        assert summary(out, rank)["losses"] == summary(uninterrupted, rank)["losses"]


def check_resumed_equals_uninterrupted(out, ref, resumed_from_step):
    for rank in (0, 1):
        s = summary(out, rank)
        assert s["start_step"] == resumed_from_step
        assert s["losses"] == summary(ref, rank)["losses"][resumed_from_step:], f"rank {rank}"
        last = ckpt.list_checkpoints(str(out / "checkpoint" / f"rank_{rank}"))[-1]
        ref_last = ckpt.list_checkpoints(str(ref / "checkpoint" / f"rank_{rank}"))[-1]
        assert os.path.basename(last) == os.path.basename(ref_last)
        a, b = params_of(last), params_of(ref_last)
        for k in b:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_sigkill_of_one_rank_then_resume_matches_uninterrupted(setup, uninterrupted, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    seed = int(os.environ.get("MSLLM_TEST_SEED", "20261122"))
    kill_at = random.Random(seed).randint(4, 7)  # a step after the step-3 checkpoint, from a printed seed
    print(f"seed {seed}: SIGKILL at step {kill_at}")
    p = launch(setup, out, wait=False)
    assert wait_for(lambda: f"step:[{kill_at:5d}/" in rank_log(out, 1)), rank_log(out, 1)[-2000:]
    kill_rank(out, 1, signal.SIGKILL)
    t = time.time()
    text, _ = p.communicate(timeout=300)
    stopped_in = time.time() - t
    assert p.returncode != 0
    assert "rank 1" in text and "rank_1/msllm.log" in text  # the launcher names the failed rank and its log
    assert stopped_in < 60  # the surviving ranks are stopped, not left hanging
    rc, text = launch(setup, out, ["--resume_training=True"])
    assert rc == 0, text[-3000:]
    resumed = summary(out, 0)["start_step"]
    assert resumed in (3, 6) and resumed <= kill_at
    check_resumed_equals_uninterrupted(out, uninterrupted, resumed)


def test_sigterm_saves_on_every_rank_then_resume_matches_uninterrupted(setup, uninterrupted, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    p = launch(setup, out, wait=False)
    assert wait_for(lambda: "step:[    4/" in rank_log(out, 0))
    p.send_signal(signal.SIGTERM)  # the launcher forwards it to every rank
    text, _ = p.communicate(timeout=300)
    assert p.returncode != 0
    steps = []
    for rank in (0, 1):
        log = rank_log(out, rank)
        assert "stopped by a signal at step" in log, log[-2000:]
        good = ckpt.good_checkpoints(str(out / "checkpoint" / f"rank_{rank}"))
        steps.append(max(good))
    assert steps[0] == steps[1] and steps[0] >= 4  # both ranks saved the same, last completed step
    rc, text = launch(setup, out, ["--resume_training=True"])
    assert rc == 0, text[-3000:]
    check_resumed_equals_uninterrupted(out, uninterrupted, steps[0])


def _tree_digest(root):
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "log" not in p.relative_to(root).parts
            and p.name != "msllm_config.yaml"}


@pytest.mark.parametrize("summaries", ["kept", "lost"])
def test_resuming_a_finished_run_does_nothing_and_exits_0(setup, uninterrupted, tmp_path, summaries):
    """A job scheduler re-runs a finished launch with --resume_training=True ("kept"), or a whole-job
    SIGKILL landed after the last step's checkpoint, before the summaries were written ("lost"):
    exit 0, say so, and leave summaries, curves and checkpoints exactly as they were."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    if summaries == "lost":
        for f in list(out.glob("train_summary_rank_*.json")) + list(out.glob("loss_curve_*.png")):
            f.unlink()
    before = _tree_digest(out)
    rc, text = launch(setup, out, ["--resume_training=True"])
    assert rc == 0, text[-3000:]
    for rank in (0, 1):
        assert f"is at step {STEPS}, the run's last (total steps {STEPS}): nothing left to do" in rank_log(out, rank)
    assert _tree_digest(out) == before
