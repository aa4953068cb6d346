"""DPO against TRL's DPOTrainer (trl 1.16.0) on the real SmolLM2-135M-Instruct and a held-out pair set made
from the bundled Alpaca records (chosen = the record's own answer, rejected = another record's answer):

1. tokenization: msllm's preference rows are TRL's ``prompt_ids + chosen_ids`` / ``+ rejected_ids``, and the
   completion (labels) is TRL's;
2. the first step: chosen and rejected summed log-probs per pair, and for sigmoid / ipo / hinge the loss and
   rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected equal
   TRL's ``_compute_loss`` and its logged metrics;
3. one SGD step from the same weights (no clipping, no loss scaling, lr 0.005): every parameter's update equal
   to TRL's (full fine-tune), then the second step's loss and metrics for each loss type (policy and reference
   now differ); and the same LoRA adapter after the step (PEFT; A copied from PEFT's initialisation; lr 0.5, since
   B starts at zero).

Each side runs in a process of its own (tests/training/dpo_trl_worker.py: the two frameworks' model copies
left the pytest process 7.7 GB larger for the rest of the run), TRL first; the test compares what they wrote.
msllm runs in PyNative mode there (no graph compiles of the 30-layer model: the run through run_msllm.py in
graph mode is tests/training/test_dpo_run.py). Seeds: TRL's ``seed`` 0 (its data order does not matter: one
batch holds every pair and the losses are means).

Tolerances (``TOL`` 1e-4): the summed log-probs of 13-35 completion tokens differ by up to ~5e-5 between the
two float32 implementations on the Intel Xeon and by up to 1.03e-4 on an AMD EPYC Zen 4 (a 35-token sum of
-92.27: 1.1e-6 relative; each side's float32 GEMMs sum in their own order, SmolLM2's logits reach |38| and
tests/lora/test_real_model_finetune.py measures the logit noise floor at ~1.3e-4), so the sums themselves are
compared within ``LOGPS_TOL`` 2e-4; the loss, rewards (beta 0.1 times differences of those sums) and
accuracies within ``TOL``; the weight updates compared are >= 100x the tolerance.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dpo_trl_worker import LOSS_TYPES, N_PAIRS

pytestmark = pytest.mark.slow

TOL = 1e-4
LOGPS_TOL = 2e-4   # summed float32 log-probs of up to 35 tokens (module doc)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dpo_trl_worker.py")


def run_side(side: str, mode: str, model_dir: str, out, *extra) -> dict:
    """Run one side in its own process; its result.json. PyTorch on one OpenMP thread, as the suite's other
    processes (tests/run_parts.sh): the other pytest worker keeps the second core busy, and TRL's side with 2
    spinning threads beside it took 84 s against 54 s with one (a busy loop on one core, 2026-12-07)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_v="3")
    r = subprocess.run([sys.executable, WORKER, side, mode, model_dir, str(out), *extra], capture_output=True,
                       text=True, timeout=1800, env=env)
    assert r.returncode == 0, f"{side} {mode}: " + (r.stdout + r.stderr)[-4000:]
    print(r.stdout[-2000:])
    with open(os.path.join(out, "result.json"), encoding="utf-8") as fh:
        return json.load(fh)


def flat_deltas(out):
    """({name: [offset, shape]}, the flat float32 updates mapped from disk)."""
    with open(os.path.join(out, "delta.json"), encoding="utf-8") as fh:
        return json.load(fh), np.load(os.path.join(out, "delta.npy"), mmap_mode="r")


@pytest.fixture(scope="module")
def full(smollm2_dir, tmp_path_factory):
    """Both sides of a full fine-tune: the first step's per-sequence log-probs and metrics, one SGD step's
    update of every parameter (on disk), the second step's metrics, msllm's rows, and TRL's tokenization."""
    d = tmp_path_factory.mktemp("dpo_trl_full")
    trl, mine = d / "trl", d / "msllm"
    ref = run_side("trl", "full", smollm2_dir, trl)
    ours = run_side("msllm", "full", smollm2_dir, mine)
    rows = np.load(mine / "rows.npz")
    return dict(trl=ref, msllm=ours, trl_dir=trl, msllm_dir=mine, ids=rows["ids"], lab=rows["lab"])


def test_rows_are_trls_tokenization(full):
    ids, lab = full["ids"], full["lab"]
    assert ids.shape[:2] == (N_PAIRS, 2)
    for i, ex in enumerate(full["trl"]["examples"]):
        for side, key in ((0, "chosen_ids"), (1, "rejected_ids")):
            whole = ex["prompt_ids"] + ex[key]
            np.testing.assert_array_equal(ids[i, side, :len(whole)], whole)
            completion = lab[i, side][lab[i, side] != -100]
            np.testing.assert_array_equal(completion, ex[key])
            assert (lab[i, side, :len(ex["prompt_ids"])] == -100).all()


def _same_metrics(mine: dict, ref: dict):
    for lt in LOSS_TYPES:
        print(lt, mine[lt], {k: ref[lt][k] for k in mine[lt]})
        for k, v in mine[lt].items():   # logps/*: batch means of the summed log-probs
            assert abs(v - ref[lt][k]) <= (LOGPS_TOL if k.startswith("logps/") else TOL), (lt, k, v, ref[lt][k])


def test_first_step_logps_loss_and_metrics_equal_trl(full):
    lc, lr, rc, rr, nc, nr = (np.array(x) for x in full["msllm"]["logps"])
    trl_c, trl_r = (np.array(x) for x in full["trl"]["logps"])
    print("msllm logps chosen", lc, "rejected", lr, "TRL", trl_c, trl_r)
    np.testing.assert_allclose(lc, trl_c, atol=LOGPS_TOL, rtol=0)
    np.testing.assert_allclose(lr, trl_r, atol=LOGPS_TOL, rtol=0)
    np.testing.assert_array_equal(lc, rc)          # policy = reference at the start
    _same_metrics(full["msllm"]["first"], full["trl"]["first"])


def test_one_sgd_step_full_equals_trl_then_second_step_metrics(full):
    assert full["msllm"]["start"] == full["trl"]["start"]      # same start: every parameter bit for bit
    (index, d_ms), (index_trl, d_trl) = flat_deltas(full["msllm_dir"]), flat_deltas(full["trl_dir"])
    assert index == index_trl
    worst, biggest = 0.0, 0.0
    for name, (start, shape) in index.items():
        n = int(np.prod(shape))
        a, b = np.asarray(d_ms[start:start + n]), np.asarray(d_trl[start:start + n])
        worst = max(worst, float(np.abs(a - b).max()))
        biggest = max(biggest, float(np.abs(b).max()))
    print(f"largest update {biggest:.3g}, largest difference of the updates {worst:.3g}")
    assert worst <= TOL and biggest >= 10 * TOL
    # second step: policy and reference differ now, so every loss type and reward is non-trivial
    assert all(abs(full["msllm"]["second"][lt]["rewards/margins"]) > 10 * TOL for lt in LOSS_TYPES)
    _same_metrics(full["msllm"]["second"], full["trl"]["second"])


def test_one_sgd_step_lora_gives_peft_adapter(smollm2_dir, tmp_path):
    trl, mine = tmp_path / "trl", tmp_path / "msllm"
    assert run_side("trl", "lora", smollm2_dir, trl)["ref_model_is_none"]   # TRL: the base with the adapter disabled
    assert not run_side("msllm", "lora", smollm2_dir, mine, "--trl_before",
                        str(trl / "adapters.npz"))["reference_holds_a_second_copy"]
    ref, ours = np.load(trl / "adapters.npz"), np.load(mine / "adapters.npz")
    names = [k[len("before/"):] for k in ref.files if k.startswith("before/")]
    assert names and set(ours.files) == {"after/" + n for n in names}
    worst, biggest = 0.0, 0.0
    for n in names:
        d_ms, d_trl = ours["after/" + n] - ref["before/" + n], ref["after/" + n] - ref["before/" + n]
        worst = max(worst, float(np.abs(d_ms - d_trl).max()))
        biggest = max(biggest, float(np.abs(d_trl).max()))
    print(f"LoRA: largest update {biggest:.3g}, largest difference of the updates {worst:.3g}")
    assert worst <= TOL and biggest >= 10 * TOL
