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
(benchmarks/workers/eval_worker.py) that runs the task twice: cold = process start to the end of
the first pass (imports, model load, msllm's graph compilation), warm = the second pass; the
summary gives median (min-max) of both over the rounds, and msllm / harness as the median (min-max)
of the per-round paired ratios (``benchmarks/ratios.py``). ``--dense``: a third run per round,
``msllm-dense``, with the output head at every position as the harness computes it (the like-for-like
row; msllm's default runs the head only at the queried positions). ``--demo_ckpt``: also the MMLU accuracy of that checkpoint
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
sys.path.insert(0, HERE)

import ratios  # noqa: E402
from msllm.fileio import write_json_atomic  # noqa: E402

WORKER = os.path.join(HERE, "workers", "eval_worker.py")
SHAPES = {"tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=688),
          "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1376)}
SEQ = 1024
QUESTIONS = 100
WHOS = ("msllm", "harness")


def make_model(shape, cache):
    from msllm.convert.verify import make_random_hf_model

    d = os.path.join(cache, f"eval_hf_{shape}")
    if not os.path.isfile(os.path.join(d, "config.json")):
        make_random_hf_model(d, seed=0, vocab_size=32000, max_position_embeddings=SEQ, **SHAPES[shape])
    return d


def run(who, task, hf_dir, out_dir, seq=SEQ, extra=()):
    out = os.path.join(out_dir, f"{who}_{task}_{time.time_ns()}.json")
    env = dict(os.environ, GLOG_v="3", OMP_NUM_THREADS="2", BENCH_SPAWN_TIME=repr(time.time()))
    cmd = [sys.executable, WORKER, who, task, hf_dir, str(seq), out, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"{who} {task} failed:\n{proc.stderr[-3000:]}")
    with open(out) as fh:
        r = json.load(fh)
    r["cmd"] = " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)
    return r


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def loadavg():
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main_real(args):
    """A real model (issue #19): SmolLM2-135M-Instruct's HF directory on both sides, MMLU 5-shot on
    ``--limit`` questions per subject; ``--repeats`` alternating rounds (msllm, harness), each run
    a fresh process scoring the questions twice: cold = spawn to the end of the first pass (imports,
    model load, graph compilation), warm = the second pass."""
    sys.path.insert(0, HERE)
    import common
    from msllm.convert.real_model import ensure_smollm2

    hf_dir = ensure_smollm2()
    cache = os.path.join(HERE, ".cache")
    os.makedirs(cache, exist_ok=True)
    extra = [str(args.batch_size), "--real_config", args.real_config, "--limit", str(args.limit)]
    report = {"machine": common.machine(), "command": " ".join([os.path.relpath(sys.executable, ROOT)] + sys.argv),
              "model": hf_dir, "seq_length": args.seq_length, "batch_size": args.batch_size,
              "limit_per_subject": args.limit, "num_fewshot": 5, "load_at_start": loadavg(), "runs": []}
    import importlib.metadata as md

    report["versions"] = {k: md.version(k) for k in ("mindspore", "torch", "transformers", "lm_eval", "tokenizers")}
    t0 = time.time()
    whos = WHOS + (("msllm-dense",) if args.dense else ())
    for rnd in range(args.repeats):
        for who in (whos if rnd % 2 == 0 else whos[::-1]):     # alternate the order between rounds
            before = loadavg()
            r = run(who, "mmlu", hf_dir, cache, args.seq_length, extra)
            r.update(round=rnd, load_before=before, load_after=loadavg())
            r["cold_s"], r["warm_s"] = r["spawn_to_first_pass_end_s"], min(r["seconds"][1:] or r["seconds"])
            report["runs"].append(r)
            n = r["results"]["n"]
            print(f"round {rnd} {who:8s} n={n} cold {r['cold_s']:.1f} s ({n / r['cold_s']:.3f} q/s)  passes "
                  f"{[round(x, 1) for x in r['seconds']]}  warm {n / r['warm_s']:.3f} q/s  acc {r['results']['acc']:.3f}"
                  f"  load {before} -> {r['load_after']}", flush=True)
    summary = {}
    for who in whos:
        rs = [r for r in report["runs"] if r["who"] == who]
        n = rs[0]["results"]["n"]
        row = {}
        for kind in ("cold", "warm"):
            qps = [n / r[f"{kind}_s"] for r in rs]
            row[kind] = {"questions_per_s_median": common.median(qps), "min": min(qps), "max": max(qps),
                         "rounds": qps, "seconds_median": common.median([r[f"{kind}_s"] for r in rs])}
        row.update(questions=n, acc=rs[0]["results"]["acc"], load_s=common.median([r["results"]["load_s"] for r in rs]),
                   import_s=common.median([r["results"]["import_s"] for r in rs]),
                   first_pass_s=common.median([r["seconds"][0] for r in rs]))
        summary[who] = row
    for kind in ("cold", "warm"):   # the median of the per-round paired ratios, with min and max
        st = ratios.paired_stats(report["runs"], "msllm", "harness", f"{kind}_s", label="who", lower_is_better=True)
        summary[f"speedup_{kind}"], summary[f"speedup_{kind}_paired"] = st["median"], st
        if args.dense:
            summary[f"speedup_dense_{kind}_paired"] = ratios.paired_stats(
                report["runs"], "msllm-dense", "harness", f"{kind}_s", label="who", lower_is_better=True)
    report.update(summary=summary, load_at_end=loadavg(), total_seconds=time.time() - t0)
    write_json_atomic(args.out, report)
    print("\n| framework | questions | cold q/s median (min-max) | warm q/s median (min-max) | load s | first pass s | acc |")
    print("|---|---|---|---|---|---|---|")
    for who in whos:
        r = summary[who]
        c, w = r["cold"], r["warm"]
        print(f"| {who} | {r['questions']} | {c['questions_per_s_median']:.3f} ({c['min']:.3f}-{c['max']:.3f}) "
              f"| {w['questions_per_s_median']:.3f} ({w['min']:.3f}-{w['max']:.3f}) | {r['load_s']:.1f} "
              f"| {r['first_pass_s']:.1f} | {r['acc']:.3f} |")
    print(f"\nmsllm / harness (paired rounds): cold {ratios.fmt(summary['speedup_cold_paired'])}x, "
          f"warm {ratios.fmt(summary['speedup_warm_paired'])}x")
    if args.dense:
        print(f"msllm-dense / harness (paired rounds, like for like): cold "
              f"{ratios.fmt(summary['speedup_dense_cold_paired'])}x, warm {ratios.fmt(summary['speedup_dense_warm_paired'])}x")
    print("wrote", args.out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["tiny", "medium"], choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tasks", nargs="+", default=["mmlu", "ppl"], choices=["mmlu", "ppl"])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "eval_speed.json"))
    ap.add_argument("--demo_ckpt", help="also report the MMLU accuracy of this checkpoint")
    ap.add_argument("--demo_config", default=os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"))
    ap.add_argument("--real", choices=["smollm2"], help="a real model instead of the random shapes (main_real)")
    ap.add_argument("--real_config", default="configs/smollm2/run_smollm2_135m.yaml")
    ap.add_argument("--limit", type=int, default=1, help="--real: MMLU questions per subject")
    ap.add_argument("--seq_length", type=int, default=2048, help="--real: msllm seq_length / HFLM max_length")
    ap.add_argument("--batch_size", type=int, default=4, help="--real: rows per forward pass, both sides")
    ap.add_argument("--dense", action="store_true", help="also msllm-dense: the output head at every position "
                    "(the like-for-like row)")
    args = ap.parse_args()
    if args.real:
        if args.out == os.path.join(HERE, "results", "eval_speed.json"):
            args.out = os.path.join(HERE, "results", f"eval_speed_{args.real}.json")
        return main_real(args)
    cache = os.path.join(HERE, ".cache")
    os.makedirs(cache, exist_ok=True)
    report = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
              "command": " ".join([os.path.relpath(sys.executable, ROOT)] + sys.argv),
              "seq_length": SEQ, "repeats": args.repeats, "load_at_start": loadavg(), "runs": [], "summary": {}}
    for shape in args.shapes:
        hf_dir = make_model(shape, cache)
        for task in args.tasks:
            whos = WHOS + (("msllm-dense",) if args.dense and task == "mmlu" else ())
            for rnd in range(args.repeats):
                for who in (whos if rnd % 2 == 0 else whos[::-1]):
                    before = loadavg()
                    r = run(who, task, hf_dir, cache)
                    r.update(shape=shape, round=rnd, load_before=before, load_after=loadavg())
                    report["runs"].append(r)
                    print(shape, task, who, r["seconds"], r["results"], flush=True)
            # cold = process start to the end of the first pass (imports, load, msllm's compilation);
            # warm = the second pass; median (min, max) over the rounds; msllm / harness: the median
            # (min, max) of the per-round paired ratios
            row = {}
            for who in whos:
                rs = [r for r in report["runs"] if (r["shape"], r["task"], r["who"]) == (shape, task, who)]
                units = QUESTIONS if task == "mmlu" else rs[0]["results"]["tokens"]
                for kind, secs in (("cold", [r["spawn_to_first_pass_end_s"] for r in rs]),
                                   ("warm", [r["seconds"][-1] for r in rs])):
                    rates = [units / s for s in secs]
                    row[f"{who}_{kind}"] = {"median": median(rates), "min": min(rates), "max": max(rates), "rounds": rates}
            key = "questions_per_s" if task == "mmlu" else "tokens_per_s"
            sub = [r for r in report["runs"] if (r["shape"], r["task"]) == (shape, task)]
            cold = ratios.paired_stats(sub, "msllm", "harness", "spawn_to_first_pass_end_s", label="who",
                                       lower_is_better=True)
            warm = ratios.paired_stats(sub, "msllm", "harness", lambda r: r["seconds"][-1], label="who",
                                       lower_is_better=True)
            report["summary"][f"{shape}_{task}"] = {key: row, "speedup_cold": cold["median"], "speedup_cold_paired": cold,
                                                    "speedup_warm": warm["median"], "speedup_warm_paired": warm}
            if "msllm-dense" in whos:
                report["summary"][f"{shape}_{task}"]["speedup_dense_warm_paired"] = ratios.paired_stats(
                    sub, "msllm-dense", "harness", lambda r: r["seconds"][-1], label="who", lower_is_better=True)
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
