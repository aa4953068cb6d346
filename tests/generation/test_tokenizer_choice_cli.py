"""Which tokenizer predict / chat / evaluate use, tested through the command line: never a silent
fallback. A model that brings no tokenizer gets the bundled LLaMA one only when its vocab_size is
LLaMA's 32000 (and the log says so); otherwise, or for a tokenizer whose ids do not fit the model,
or the bundled tokenizer forced on a non-32000 model, one clear error before any output, exit 2."""

import os
import subprocess
import sys

import pytest
import yaml

from gentest_helpers import ROOT, TINY_YAML
from msllm.convert.verify import make_random_hf_model

SEED = 7
SMALL = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
BUNDLED = os.path.join(ROOT, "examples", "data", "tokenizer.model")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two random HF directories without tokenizer files: vocab 49152 and vocab 32000, and a run YAML."""
    d = tmp_path_factory.mktemp("tokchoice")
    print("seed", SEED)
    make_random_hf_model(str(d / "v49152"), seed=SEED, vocab_size=49152, **SMALL)
    make_random_hf_model(str(d / "v32000"), seed=SEED, vocab_size=32000, **SMALL)
    run = yaml.safe_load(open(TINY_YAML))
    run["model"]["model_config"]["seq_length"] = 64
    run["generation_config"] = {"max_new_tokens": 4}
    with open(d / "run.yaml", "w") as fh:
        yaml.safe_dump(run, fh)
    return d


def run(tool, models, model, *args):
    cmd = [sys.executable, os.path.join(ROOT, *tool), "--config", str(models / "run.yaml"),
           "--load_checkpoint", str(models / model), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, GLOG_v="3"),
                          cwd=str(models))


def errors(r):
    return [x for x in r.stderr.splitlines() if x.startswith("error: ")]


PREDICT = ("run_msllm.py",)
CHAT = ("tools", "chat.py")
EVAL = ("tools", "evaluate.py")


@pytest.mark.parametrize("tool,extra", [
    (PREDICT, ["--run_mode", "predict", "--predict_data", "hello"]),
    (CHAT, ["--prompt", "hello"]),
    (EVAL, ["--task", "ppl", "--data_dir", os.path.join(ROOT, "examples", "data", "wiki_demo.txt")]),
])
def test_no_tokenizer_and_not_llama_vocab_is_one_error(models, tmp_path, tool, extra):
    r = run(tool, models, "v49152", *extra, f"--output_dir={tmp_path / 'out'}")
    assert r.returncode == 2, r.stderr[-2000:]
    err = errors(r)
    assert len(err) == 1 and "brings no tokenizer and the model's vocab_size is 49152" in err[0], r.stderr[-2000:]
    assert r.stdout.strip() == ""
    assert not (tmp_path / "out" / "predict").exists()


def test_bundled_tokenizer_forced_on_another_vocab_is_refused(models):
    r = run(PREDICT, models, "v49152", "--run_mode", "predict", "--predict_data", "hello", "--tokenizer", BUNDLED)
    assert r.returncode == 2
    err = errors(r)
    assert len(err) == 1 and "is the bundled LLaMA tokenizer (32000 ids)" in err[0] and "vocab_size 49152" in err[0]
    assert r.stdout.strip() == ""


def test_tokenizer_with_more_ids_than_the_model_is_refused(models, smollm2_dir):
    r = run(PREDICT, models, "v32000", "--run_mode", "predict", "--predict_data", "hello", "--tokenizer", smollm2_dir)
    assert r.returncode == 2
    err = errors(r)
    assert len(err) == 1 and "has 49152 ids but the model" in err[0] and "vocab_size 32000" in err[0], err
    assert r.stdout.strip() == ""


def test_llama_vocab_without_tokenizer_uses_the_bundled_one_and_says_so(models):
    r = run(PREDICT, models, "v32000", "--run_mode", "predict", "--predict_data", "hello")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the bundled LLaMA tokenizer; the checkpoint names none" in r.stderr
    assert "tokenizer: " + BUNDLED in r.stderr


def test_malformed_tokenizer_json_is_one_error(models, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    r = run(PREDICT, models, "v32000", "--run_mode", "predict", "--predict_data", "hello", "--tokenizer", str(bad))
    assert r.returncode == 2
    err = errors(r)
    assert len(err) == 1 and "not a Hugging Face tokenizer.json" in err[0] and str(bad) in err[0]
