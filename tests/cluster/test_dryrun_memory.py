"""Issue #30: what a pipelined rank keeps in device memory, read from MindSpore's own memory tracker
(``MS_ALLOC_CONF=memory_tracker:True``: every block's type, owner and lifetime) in a dry-run.

MindSpore's ``PipelineGradReducer`` clears each gradient accumulator with ``zeros_like``, which its
frontend folds into one constant per accumulator kept for the whole run (615 MiB on a 4-layer 13B
rank, docs/dryrun.md); msllm's reducer (:func:`msllm.training.pipeline.accumulator_reducer`)
computes the zeros instead. Compiled: rank 5 of the tiny model, dp2 x mp2 x pp2, optimizer shard on
(the path where MindSpore's reducer folds them). The reducer's arithmetic is checked on CPU against
MindSpore's own reducer.

Seed: numpy 0 (printed).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")
LAYOUT = ["--parallel.parallel_mode=1", "--parallel.full_batch=True", "--parallel_config.data_parallel=2",
          "--parallel_config.model_parallel=2", "--parallel_config.pipeline_stage=2",
          "--parallel_config.micro_batch_num=2", "--parallel_config.optimizer_shard=True",
          "--runner_config.batch_size=1", "--model.model_config.seq_length=64"]


@pytest.mark.slow
def test_pipelined_rank_keeps_no_zero_constants_for_its_accumulators(tmp_path):
    tracker = tmp_path / "tracker"
    env = dict(os.environ, MS_ALLOC_CONF=f"memory_tracker:True,memory_tracker_path:{tracker}")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", TINY, "--run_mode", "train",
                           "--sim_level", "1", "--sim_rank_id", "5", *LAYOUT, f"--output_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    with open(tracker / "rank_5" / "memory_block.csv", newline="") as fh:
        blocks = list(csv.DictReader(fh))
    accumulators = [int(b["size"]) for b in blocks if b["node_name"].startswith("accu_grads.")]
    constants = [int(b["size"]) for b in blocks if b["type"] == "ConstantValue"]
    assert sum(accumulators) > 16 << 20            # the stage's accumulators are there (the head's 16 MB) ...
    assert max(constants) < min(accumulators)      # ... and every constant is smaller than the smallest of them


def test_reducer_scales_and_clears_as_mindspores_own():
    """Standalone on CPU with the optimizer-shard branch forced: the gradients divided by the scale as
    MindSpore's reducer divides them, every accumulator left exactly zero (an inf in it included)."""
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, Tensor, nn

    from msllm.training.pipeline import accumulator_reducer

    seed = 0
    print(f"numpy seed {seed}")
    rng = np.random.default_rng(seed)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    params = ParameterTuple([Parameter(Tensor(rng.standard_normal(s).astype(np.float32)), name=f"w{i}")
                             for i, s in enumerate([(4, 3), (5,)])])
    grads = tuple(Tensor(rng.standard_normal(p.shape).astype(np.float32)) for p in params)
    ours = accumulator_reducer(params, 8.0)
    theirs = nn.PipelineGradReducer(params, scale_sense=8.0, opt_shard=True)
    ours.opt_shard = True
    for acc in ours.accu_grads:
        acc.set_data(Tensor(np.full(acc.shape, np.inf, np.float32)))
    out, ref = ours(grads), theirs(grads)
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    for acc in ours.accu_grads:
        assert not np.any(acc.asnumpy()), acc.name
