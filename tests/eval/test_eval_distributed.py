"""2-rank evaluation through scripts/run_distribute.sh equals 1-rank evaluation exactly: every
request's log-likelihood bit for bit, and the accuracy (MMLU 5-shot on the real sample, a random
HF model loaded from its directory)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from evaltest_helpers import EVAL_DATA, HF_CONFIG, REPO
from helpers import TINY_YAML as TINY
from helpers.distributed import run_two_ranks, two_rank_table

pytestmark = pytest.mark.slow


def results(out):
    files = glob.glob(os.path.join(out, "eval", "results_mmlu_*.json"))
    assert len(files) == 1, files
    with open(files[0], encoding="utf-8") as fh:
        return json.load(fh)


def test_two_rank_mmlu_equals_one_rank(models, tmp_path):
    hf_dir = models[3]
    task = ["--task", "mmlu", "--data_dir", os.path.join(EVAL_DATA, "mmlu"), "--num_fewshot", "5",
            "--limit", "3", "--batch_size", "2", "--load_checkpoint", hf_dir]
    one = tmp_path / "one"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "evaluate.py"), "--config", TINY,
                           "--output_dir", str(one), *task], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, GLOG_v="3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = tmp_path / "two"
    rc, text = run_two_ranks(two_rank_table(tmp_path), TINY, "eval", two, task, timeout=900,
                             MSLLM_ENTRY=os.path.join(REPO, "tools", "evaluate.py"))
    logs = "".join(open(p, encoding="utf-8", errors="replace").read()[-2000:]
                   for p in glob.glob(str(two / "log" / "rank_*" / "msllm.log")))
    assert rc == 0, text[-2000:] + logs
    a, b = results(str(one)), results(str(two))
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert [d["loglikelihoods"] for d in a["docs"]] == [d["loglikelihoods"] for d in b["docs"]]  # bit-exact
    assert a["results"] == b["results"] and a["subjects"] == b["subjects"]
    assert len(a["docs"]) == 12 and HF_CONFIG["hidden_size"] == 64
    assert "mmlu: acc" in open(glob.glob(str(two / "log" / "rank_0" / "msllm.log"))[0], encoding="utf-8").read()
