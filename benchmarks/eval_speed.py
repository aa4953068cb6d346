"""Evaluation speed: msllm vs lm-evaluation-harness's HF backend (torch, 2 threads), alternating.

    .venv/bin/python benchmarks/eval_speed.py [--shapes tiny medium] [--repeats 2] [--out benchmarks/results/eval_speed.json]
        [--demo_ckpt output/demo/checkpoint/rank_0] [--demo_config configs/llama/run_llama_tiny.yaml]

Per shape (random LLaMA, tiny: hidden 256, 4 layers, 4 heads, FFN 688; medium: hidden 512,
8 layers, 8 heads, FFN 1376; vocabulary 32000, context 1024):
* MMLU-format questions per second, 5-shot, the 100 real questions of examples/data/eval/mmlu
  (msllm: warm run, graphs compiled; cold run with compilation also recorded);
* perplexity tokens per second over 60 kB of the bundled Wikipedia text, disjoint windows of
  1024 tokens (msllm --stride 1024 vs a direct transformers loop).
Runs alternate msllm / harness ``--repeats`` times, each in a fresh process
(benchmarks/workers/eval_worker.py). ``--demo_ckpt``: also the MMLU accuracy of that checkpoint
(the demo model; chance level, 25%, is expected of models this small). Raw JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from msllm.fileio import write_json_atomic  # noqa: E402

WORKER = os.path.join(HERE, "workers", "eval_worker.py")
SHAPES = {"tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=688),
          "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1376)}
SEQ = 1024
QUESTIONS = 100


def make_model(shape, cache):
    from msllm.convert.verify import make_random_hf_model

    d = os.path.join(cache, f"eval_hf_{shape}")
    if not os.path.isfile(os.path.join(d, "config.json")):
        make_random_hf_model(d, seed=0, vocab_size=32000, max_position_embeddings=SEQ, **SHAPES[shape])
    return d


def run(who, task, hf_dir, out_dir):
    out = os.path.join(out_dir, f"{who}_{task}_{time.time_ns()}.json")
    env = dict(os.environ, GLOG_v="3", OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, WORKER, who, task, hf_dir, str(SEQ), out], capture_output=True,
                          text=True, env=env, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"{who} {task} failed:\n{proc.stderr[-3000:]}")
    with open(out) as fh:
        return json.load(fh)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["tiny", "medium"], choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tasks", nargs="+", default=["mmlu", "ppl"], choices=["mmlu", "ppl"])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "eval_speed.json"))
    ap.add_argument("--demo_ckpt", help="also report the MMLU accuracy of this checkpoint")
    ap.add_argument("--demo_config", default=os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"))
    args = ap.parse_args()
    cache = os.path.join(HERE, ".cache")
    os.makedirs(cache, exist_ok=True)
    report = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
              "note": "shared 2-core machine; other jobs were running (numbers are noisy)",
              "seq_length": SEQ, "runs": [], "summary": {}}
    for shape in args.shapes:
        hf_dir = make_model(shape, cache)
        for task in args.tasks:
            for _ in range(args.repeats):
                for who in ("msllm", "harness"):
                    r = run(who, task, hf_dir, cache)
                    r["shape"] = shape
                    report["runs"].append(r)
                    print(shape, task, who, r["seconds"], r["results"], flush=True)
            best = {}
            for who in ("msllm", "harness"):
                rs = [r for r in report["runs"] if (r["shape"], r["task"], r["who"]) == (shape, task, who)]
                secs = min(r["seconds"][-1] for r in rs)
                units = QUESTIONS if task == "mmlu" else rs[0]["results"]["tokens"]
                best[who] = units / secs
            key = "questions_per_s" if task == "mmlu" else "tokens_per_s"
            report["summary"][f"{shape}_{task}"] = {key: best, "speedup": best["msllm"] / best["harness"]}
            print(shape, task, report["summary"][f"{shape}_{task}"], flush=True)
    if args.demo_ckpt:
        out_dir = os.path.join(cache, "demo_eval")
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), "--config", args.demo_config,
                               "--load_checkpoint", args.demo_ckpt, "--task", "mmlu", "--data_dir",
                               os.path.join(ROOT, "examples", "data", "eval", "mmlu"), "--num_fewshot", "5",
                               "--output_dir", out_dir], capture_output=True, text=True, timeout=7200)
        report["demo_model_mmlu"] = [ln for ln in proc.stdout.splitlines() if ln.startswith("mmlu:")]
    write_json_atomic(args.out, report)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
