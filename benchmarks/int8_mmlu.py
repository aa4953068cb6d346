"""MMLU log-likelihoods of SmolLM2-135M-Instruct with weight-only int8 against float32 (issue #32).

Runs ``tools/evaluate.py --task mmlu`` (msllm's lm-evaluation-harness-equal scoring, docs/evaluation.md)
once per mode on the same data, then compares request by request: every choice's log-likelihood
(max and mean |difference|), the predicted letter (how many questions change their answer) and the
accuracy. Modes: float32, int8 per output channel (``param_init_type: int8``), int8 per group of 128
(``quantization_config``), optionally bfloat16 storage for scale.

    .venv/bin/python benchmarks/int8_mmlu.py                                  # the bundled 4 subjects, 5-shot
    .venv/bin/python benchmarks/int8_mmlu.py --data_dir MMLU_DIR --limit 50  # the real MMLU, 50 per subject

Writes ``benchmarks/results/int8_mmlu_smollm2.json`` (the comparison; each mode's own results JSON
stays in its output directory) and prints a Markdown table. Accuracy is not a speed figure: a
shared machine changes only the wall times, which are printed for orientation.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "configs", "smollm2", "run_smollm2_135m.yaml")
MODES = {"float32": [],
         "int8_per_channel": ["--model.model_config.param_init_type=int8"],
         "int8_per_group_128": ["--model.model_config.quantization_config={quant_method: rtn, "
                                "weight_quant_granularity: per_group, group_size: 128}"],
         "bfloat16": ["--model.model_config.param_init_type=bfloat16"]}


def run_mode(mode: str, args) -> tuple[dict, float]:
    """tools/evaluate.py for one mode: (its results JSON, wall seconds); with ``--reuse`` the newest
    results JSON already in the mode's output directory (wall seconds then None)."""
    out = os.path.join(args.output_dir, mode)
    done = sorted(glob.glob(os.path.join(out, "eval", "results_mmlu_*.json")), key=os.path.getmtime)
    if args.reuse and done:
        with open(done[-1]) as fh:
            return json.load(fh), None
    cmd = [sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), "--config", CONFIG, "--load_checkpoint",
           args.model, "--task", "mmlu", "--data_dir", args.data_dir, "--num_fewshot", str(args.num_fewshot),
           f"--output_dir={out}", *MODES[mode]]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, GLOG_v="3"))
    if p.returncode != 0:
        raise SystemExit(f"{mode}: evaluate.py failed:\n{p.stderr[-3000:]}")
    files = sorted(glob.glob(os.path.join(out, "eval", "results_mmlu_*.json")), key=os.path.getmtime)
    with open(files[-1]) as fh:
        return json.load(fh), time.time() - t0


def compare(ref: dict, got: dict) -> dict:
    """Request-by-request comparison of two results JSONs of the same questions."""
    a = np.array([d["loglikelihoods"] for d in ref["docs"]], np.float64)
    b = np.array([d["loglikelihoods"] for d in got["docs"]], np.float64)
    assert [d["where"] for d in ref["docs"]] == [d["where"] for d in got["docs"]]
    pa, pb = a.argmax(1), b.argmax(1)
    return {"acc": got["results"]["acc"], "acc_float32": ref["results"]["acc"],
            "max_abs_loglik_diff": float(np.abs(a - b).max()), "mean_abs_loglik_diff": float(np.abs(a - b).mean()),
            "changed_answers": int((pa != pb).sum()), "questions": int(len(pa))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/msllm/SmolLM2-135M-Instruct"))
    p.add_argument("--data_dir", default=os.path.join(ROOT, "examples", "data", "eval", "mmlu"))
    p.add_argument("--num_fewshot", type=int, default=5)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--modes", default="float32,int8_per_channel,int8_per_group_128")
    p.add_argument("--output_dir", default=os.path.join(HERE, ".cache", "int8_mmlu"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "int8_mmlu_smollm2.json"))
    p.add_argument("--reuse", action="store_true", help="take a mode's earlier results from --output_dir")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    results, walls = {}, {}
    for mode in modes:
        results[mode], walls[mode] = run_mode(mode, args)
        wall = "reused" if walls[mode] is None else f"{walls[mode]:.0f} s"
        print(f"{mode}: acc {results[mode]['results']['acc']:.4f} ({wall})", flush=True)
    table = {m: compare(results["float32"], results[m]) for m in modes if m != "float32"}
    summary = {"model": args.model, "data_dir": args.data_dir, "num_fewshot": args.num_fewshot, "limit": args.limit,
               "files": results["float32"].get("files"), "float32_acc": results["float32"]["results"]["acc"],
               "vs_float32": table, "wall_s": walls,
               "note": "wall times taken on a shared 2-core machine (other jobs running): not speed figures"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(summary, fh, indent=1)
    print("\n| mode | acc | float32 acc | changed answers | max / mean abs log-lik diff |\n|---|---|---|---|---|")
    for m, r in table.items():
        print(f"| {m} | {r['acc']:.4f} | {r['acc_float32']:.4f} | {r['changed_answers']} of {r['questions']} | "
              f"{r['max_abs_loglik_diff']:.4f} / {r['mean_abs_loglik_diff']:.4f} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
