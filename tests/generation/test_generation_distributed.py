"""Predict through ``scripts/run_distribute.sh`` on 2 data-parallel CPU ranks: the prompts file is
split across the ranks and the merged JSONL (rank 0, input order) equals a one-rank run's."""

import json
import os
import subprocess
import sys

import pytest

from gentest_helpers import ROOT, TINY_YAML
from helpers.distributed import rank_log, run_two_ranks, two_rank_table
from msllm.convert.verify import make_random_hf_model

pytestmark = pytest.mark.slow

HF_KW = dict(vocab_size=32000, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=128)
PROMPTS = ["I love Beijing, because", "Hello", "The capital of France is Paris, and the capital of Germany is",
           "Give three tips for staying healthy.", "Once upon a time", "What is 2 + 2?", "Translate: good morning"]


SEED = 51


def test_two_ranks_equal_one_rank(tmp_path):
    print("seed", SEED)
    make_random_hf_model(str(tmp_path / "hf"), seed=SEED, **HF_KW)
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS) + "\n")
    common = ["--load_checkpoint", str(tmp_path / "hf"), "--predict_data", str(data),
              "--generation_config.max_new_tokens=12", "--generation_config.batch_size=2"]
    rc, text = run_two_ranks(two_rank_table(tmp_path), TINY_YAML, "predict", tmp_path / "dp", common, timeout=600)
    logs = rank_log(tmp_path / "dp", 0) + rank_log(tmp_path / "dp", 1)
    assert rc == 0, text[-4000:] + logs[-4000:]
    # record i went to rank i % 2: rank 0 decoded 4 of the 7 prompts, rank 1 the other 3
    assert "[rank 0] predict: this rank decodes 4 of the 7 prompt(s)" in logs
    assert "[rank 1] predict: this rank decodes 3 of the 7 prompt(s)" in logs
    two = [json.loads(x) for x in (tmp_path / "dp" / "predict" / "predictions.jsonl").read_text().splitlines()]

    one_out = tmp_path / "one"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", TINY_YAML, "--run_mode",
                        "predict", f"--output_dir={one_out}", *common], cwd=str(tmp_path),
                       env=dict(os.environ, GLOG_v="3"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    one = [json.loads(x) for x in (one_out / "predict" / "predictions.jsonl").read_text().splitlines()]

    assert [x["index"] for x in two] == list(range(len(PROMPTS)))
    assert [x["prompt"] for x in two] == PROMPTS
    strip = [{k: v for k, v in x.items() if k != "tokens_per_s"} for x in one]
    assert [{k: v for k, v in x.items() if k != "tokens_per_s"} for x in two] == strip
    assert len({tuple(x["output_ids"]) for x in two}) == len(PROMPTS)
