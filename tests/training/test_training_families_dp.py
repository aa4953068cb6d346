"""Data parallel is exact for every member of the LLaMA family: 2 CPU ranks started by
scripts/run_distribute.sh, each on half of a batch, give the loss (the mean of the ranks') and the
parameter update of one process on the whole batch, for LLaMA, Qwen2, Qwen3, Mistral, Gemma,
LLaMA with attention biases and the mixture-of-experts Mixtral, Qwen3-MoE and Qwen2-MoE (whose
load-balancing loss counts the global batch's routing: moe.py). One launch runs every case
(tests/training/family_dp_worker.py, msllm's own network, optimizer and train-step builders)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, TINY_YAML
from helpers.distributed import run_two_ranks, two_rank_table
from helpers.families import FAMILY_CASES

pytestmark = pytest.mark.slow

WORKER = os.path.join(REPO, "tests", "training", "family_dp_worker.py")
SEED = 20261126
CASES = {"llama_plain": dict(model_type="llama", vocab_size=600, hidden_size=48, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128), **FAMILY_CASES}
B, T = 4, 24   # T longer than the Mistral case's window (16)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{case: ([rank 0, rank 1] results of the 2-rank launch, the single process's result)}."""
    from msllm.convert.verify import make_random_hf_model

    root = tmp_path_factory.mktemp("families_dp")
    cases = root / "cases"
    cases.mkdir()
    print("seed", SEED)
    for i, (name, kw) in enumerate(sorted(CASES.items())):
        make_random_hf_model(str(cases / name), seed=SEED + i, **kw)
    batch = np.random.default_rng(SEED).integers(3, 600, (B, T + 1)).astype(np.int32)
    np.save(cases / "batch.npy", batch)
    two, one = root / "two", root / "one"
    out = root / "launch"
    out.mkdir()
    rc, text = run_two_ranks(two_rank_table(root), TINY_YAML, "finetune", out,
                             ["--cases", str(cases), "--result_dir", str(two)], timeout=1200, MSLLM_ENTRY=WORKER)
    assert rc == 0, text[-4000:]
    env = {k: v for k, v in os.environ.items() if k not in ("MS_WORKER_NUM", "RANK_SIZE", "RANK_ID", "MS_ROLE")}
    r = subprocess.run([sys.executable, WORKER, "--config", TINY_YAML, "--run_mode", "finetune", "--cases", str(cases),
                        "--result_dir", str(one)], env=dict(env, GLOG_v="3"), capture_output=True, text=True,
                       timeout=1200, cwd=str(root))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    load = lambda p: dict(np.load(p))   # noqa: E731
    return {c: ([load(two / f"{c}_rank{r}.npz") for r in (0, 1)], load(one / f"{c}_rank0.npz")) for c in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_give_the_loss_and_update_of_one_rank_on_the_whole_batch(results, case):
    ranks, whole = results[case]
    losses = [float(r["loss"]) for r in ranks]
    assert losses[0] != losses[1]                                  # the ranks saw different rows
    assert np.mean(losses) == pytest.approx(float(whole["loss"]), rel=1e-5, abs=0)
    deltas = [k for k in whole if k.startswith("delta/")]
    assert deltas and set(deltas) == {k for k in ranks[0] if k.startswith("delta/")}
    for k in deltas:
        np.testing.assert_array_equal(ranks[0][k], ranks[1][k], err_msg=k)     # one update on every rank
        scale = float(np.abs(whole[k]).max())
        assert scale > 0, k
        # atol: fp32 parameters near 0.02 carry ~2e-9 rounding in after - before, ~1e-3 of the largest update
        np.testing.assert_allclose(ranks[0][k], whole[k], rtol=1e-4, atol=1e-3 * scale, err_msg=k)
    if "moe" in case:   # the router stats: the balancing loss's mean is the whole batch's; shares equal
        s0, s1, sw = ranks[0]["stats"], ranks[1]["stats"], whole["stats"]
        assert (s0[0] + s1[0]) / 2 == pytest.approx(float(sw[0]), rel=1e-5)
        np.testing.assert_allclose(s0[2:], sw[2:], rtol=1e-6)
        np.testing.assert_allclose(s1[2:], sw[2:], rtol=1e-6)
