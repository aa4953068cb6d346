"""Real context lengths (issue #31): Llama-3.1-shaped models (131,072 positions, llama3 rope
scaling; and Qwen2.5's 32,768) with a tiny hidden size, used the way a user does, each command in
its own process: predict, evaluation (perplexity), one LoRA fine-tuning step and a request
through the OpenAI-compatible server. Each process peaks under 3 GB of RSS: nothing is sized by
``max_position_embeddings`` (a (P, P) float32 mask alone would be 64 GiB at 131,072). Greedy tokens
equal transformers' on the same directory, and the perplexity's summed NLL equals a transformers
forward pass.

The models are random (seeded) transformers ``LlamaForCausalLM``s saved as Hugging Face
directories with SmolLM2's tokenizer files (a real byte-level BPE, 49,152 ids)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers import REPO

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

SEED = 31
YAML = os.path.join(REPO, "configs", "smollm2", "run_smollm2_135m.yaml")
RSS_LIMIT_KB = 3 * 1024 * 1024
PROMPT = "The history of the printing press begins in"
NEW = 8
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# each command runs under this wrapper, which prints the process's peak RSS (KiB) when it ends:
# VmHWM of /proc/self/status, the high-water mark of this program's own memory (getrusage's
# ru_maxrss would also count the pytest process it was forked from: Linux keeps it across exec)
PEAK = ("import re, runpy, sys\n"
        "sys.argv = sys.argv[1:]\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "finally:\n"
        "    hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
        "    print('PEAK_RSS_KB', hwm, flush=True)\n")


def make_model(directory, positions: int, rope_scaling, smollm2_dir):
    """A random tiny LLaMA with ``positions`` positions as an HF directory; returns (model, tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                      rope_theta=500000.0, rope_scaling=rope_scaling, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.isfile(os.path.join(smollm2_dir, name)):
            shutil.copy(os.path.join(smollm2_dir, name), directory)
    return model, AutoTokenizer.from_pretrained(directory)


def run(script, args, cwd, timeout=900):
    """``script`` with ``args`` in a child process; returns (completed process, peak RSS KiB)."""
    r = subprocess.run([sys.executable, "-c", PEAK, script, *map(str, args)], cwd=str(cwd), capture_output=True,
                       text=True, timeout=timeout, env=dict(os.environ, GLOG_v="3"))
    peak = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("PEAK_RSS_KB")]
    assert r.returncode == 0 and peak, (r.stdout[-3000:], r.stderr[-3000:])
    print(f"{os.path.basename(script)}: peak RSS {peak[0] / 1024:.0f} MiB")
    return r, peak[0]


def reference_tokens(model, tok):
    """(prompt ids, transformers' greedy new tokens up to and including EOS 2, as HF keeps it)."""
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=2, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    return ids[0].tolist(), new[:new.index(2) + 1] if 2 in new else new


BUILT: dict = {}


def built(positions, tmp_path_factory, smollm2_dir):
    """The model of ``positions`` (built once per test run)."""
    if positions not in BUILT:
        d = tmp_path_factory.mktemp(f"long_{positions}")
        model, tok = make_model(d / "hf", positions, LLAMA31_ROPE if positions == 131072 else None, smollm2_dir)
        print("seed", SEED)
        BUILT[positions] = positions, d, model, tok
    return BUILT[positions]


@pytest.fixture(scope="module", params=[131072, 32768], ids=["llama3.1_131072", "qwen2.5_32768"])
def long_model(request, tmp_path_factory, smollm2_dir):
    return built(request.param, tmp_path_factory, smollm2_dir)


@pytest.fixture(scope="module")
def llama31(tmp_path_factory, smollm2_dir):
    """The 131,072-position model alone (the LoRA step and the server: the same code paths as at
    32,768, run once for CI time)."""
    return built(131072, tmp_path_factory, smollm2_dir)


def test_predict_tokens_equal_transformers(long_model):
    positions, d, model, tok = long_model
    prompt_ids, ref = reference_tokens(model, tok)
    (d / "prompts.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n")
    _, peak = run(os.path.join(REPO, "run_msllm.py"),
                  ["--config", YAML, "--run_mode", "predict", "--load_checkpoint", d / "hf", "--template", "none",
                   "--predict_data", d / "prompts.jsonl", f"--generation_config.max_new_tokens={NEW}",
                   f"--output_dir={d / 'out'}"], d)
    rec = json.loads((d / "out" / "predict" / "predictions.jsonl").read_text().splitlines()[0])
    assert rec["prompt_tokens"] == len(prompt_ids) and rec["output_ids"] == ref
    assert peak < RSS_LIMIT_KB


def test_perplexity_equals_transformers(long_model):
    positions, d, model, tok = long_model
    text = "Johannes Gutenberg introduced movable-type printing to Europe around 1440, starting the printing revolution."
    (d / "text.jsonl").write_text(json.dumps({"text": text}) + "\n")
    _, peak = run(os.path.join(REPO, "tools", "evaluate.py"),
                  ["--config", YAML, "--load_checkpoint", d / "hf", "--task", "ppl", "--data_dir", d / "text.jsonl",
                   f"--output_dir={d / 'eval'}"], d)
    results = [f for f in os.listdir(d / "eval" / "eval") if f.startswith("results_ppl")]
    payload = json.loads((d / "eval" / "eval" / results[0]).read_text())
    assert payload["max_length"] == positions            # the directory's positions, as lm-eval's HFLM
    doc = payload["docs"][0]
    # lm-eval's rolling log-likelihood: its prefix token (BOS, else EOS), then the text, every text
    # token scored; here in one window
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[prefix] + tok(text).input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    ref = -logp.gather(1, ids[0, 1:, None]).sum().item()
    assert doc["tokens"] == ids.shape[1] - 1
    assert abs(doc["nll_sum"] - ref) / ref < 1e-4
    assert peak < RSS_LIMIT_KB


def test_one_lora_step(llama31, alpaca_path):
    positions, d, _, _ = llama31
    r, _ = run(os.path.join(REPO, "data_preprocess", "alpaca_converter.py"),
               ["--data_path", alpaca_path, "--output_path", d / "conv.json"], d)
    r, _ = run(os.path.join(REPO, "data_preprocess", "llama_preprocess.py"),
               ["--input_glob", d / "conv.json", "--dataset_type", "qa", "--model_file", d / "hf", "--seq_length", 64,
                "--output_file", d / "sft.mindrecord", "--no_progress", "--samples_num", 4], d)
    r, peak = run(os.path.join(REPO, "run_msllm.py"),
                  ["--config", YAML, "--run_mode", "finetune", "--load_checkpoint", d / "hf",
                   "--train_dataset_dir", d / "sft.mindrecord", "--model.model_config.seq_length=64",
                   "--runner_config.batch_size=1", "--runner_config.train_steps=1",
                   "--callbacks.loss_monitor.per_print_times=1", "--model.model_config.pet_config.pet_type=lora",
                   "--model.model_config.pet_config.lora_rank=4", f"--output_dir={d / 'ft'}"], d)
    assert "loss" in (r.stdout + r.stderr)
    assert os.path.isdir(d / "ft" / "checkpoint")
    assert peak < RSS_LIMIT_KB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_request_equals_transformers(llama31):
    positions, d, model, tok = llama31
    _, ref = reference_tokens(model, tok)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", PEAK, os.path.join(REPO, "tools", "serve.py"), "--config", YAML,
                             "--load_checkpoint", str(d / "hf"), "--host", "127.0.0.1", "--port", str(port)],
                            cwd=str(d), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, GLOG_v="3"))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()[-3000:]
                time.sleep(1)
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())
        body = json.dumps({"model": models["data"][0]["id"], "prompt": PROMPT, "max_tokens": NEW,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=300).read())
        status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read())
        print("health:", status)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    assert answer["choices"][0]["text"] == tok.decode([t for t in ref if t != 2])
    peak = [int(line.split()[1]) for line in out.splitlines() if line.startswith("PEAK_RSS_KB")]
    print(f"serve.py: peak RSS {peak[0] / 1024:.0f} MiB")
    assert peak and peak[0] < RSS_LIMIT_KB
