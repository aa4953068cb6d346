"""Paired ratios of benchmark runs: the convention every "x faster" figure of BENCHMARKS.md follows.

A ratio between two frameworks is computed **round by round**: the run of A in round i divided by the
run of B in the same round (the runs of one round alternate, so load that lasts across both weighs on
both sides), and the figure reported is the **median of these per-round ratios, with their min and
max**. It is not the ratio of the two medians (with 3 rounds the two can differ by several percent:
SmolLM2 full fine-tuning's rounds 1.59 / 1.49 / 1.26 give 1.49, its medians' ratio 1.52).

Library (used by the benchmark scripts' own summaries)::

    paired(runs, num, den, value, label="framework", match=(), lower_is_better=False) -> [ratio per round]
    stats(ratios) -> {"median", "min", "max", "rounds", "n"}
    fmt(stats) -> "1.49 (1.26-1.59)"   ("1.03 (1 round: unpaired)" when there is a single round)
    paired_stats(...) = stats(paired(...))

Command line (no new runs; reads result files)::

    .venv/bin/python benchmarks/ratios.py benchmarks/results/lora_speed_smollm2.json [more files]

prints every comparison the file's script reports, as median (min-max) of the paired rounds and
each round's ratio. A run's round is its ``round`` field; files written before the scripts recorded
it (``eval_speed*.json``) alternate A, B, A, B in order, so the i-th A run is paired with the i-th B
run of the same shape and task (``round`` absent: the occurrence order stands for it).
"""
import argparse
import json
import os
import sys

import numpy as np


def _value(run, value):
    return value(run) if callable(value) else run.get(value)


def _rounds(runs, who, label, match):
    """{(match values..., round): run} for the runs of label ``who``; without a ``round`` field the
    occurrence index among the runs of the same label and match values stands for it."""
    out, seen = {}, {}
    for r in runs:
        lab = label(r) if callable(label) else r.get(label)
        if lab != who:
            continue
        key = tuple(r.get(m) for m in match)
        rnd = r.get("round")
        if rnd is None:
            rnd = seen.get(key, 0)
            seen[key] = rnd + 1
        out[key + (rnd,)] = r
    return out


def paired(runs, num, den, value, *, label="framework", match=(), lower_is_better=False):
    """Per-round ratios num / den of ``value`` (a key of the run dict, or a function of the run).

    ``runs``: the result file's list of runs; ``label``: the field (or function) naming a run's
    framework; ``match``: fields that must be equal for two runs to be paired besides the round (e.g.
    ``("shape", "batch")``); ``lower_is_better``: ``value`` is a time, so the ratio is den / num
    (how many times faster num is). Rounds where either side is missing or failed (value None) are
    skipped. Returned in round order."""
    a, b = _rounds(runs, num, label, match), _rounds(runs, den, label, match)
    out = []
    for key in sorted(set(a) & set(b), key=lambda k: (k[-1], str(k[:-1]))):
        va, vb = _value(a[key], value), _value(b[key], value)
        if va is None or vb is None or not va or not vb:
            continue
        out.append(vb / va if lower_is_better else va / vb)
    return out


def stats(ratios):
    """Median, min and max of per-round ratios (NaN median when there are none)."""
    xs = [float(x) for x in ratios]
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "rounds": [], "n": 0}
    return {"median": float(np.median(np.asarray(xs, np.float64))), "min": min(xs), "max": max(xs),
            "rounds": xs, "n": len(xs)}


def paired_stats(runs, num, den, value, **kw):
    return stats(paired(runs, num, den, value, **kw))


def fmt(s, digits=2):
    """'1.49 (1.26-1.59)'; a single round says so instead of showing a range."""
    if not s["n"]:
        return "n/a"
    m = f"{s['median']:.{digits}f}"
    if s["n"] == 1:
        return f"{m} (1 round: unpaired)"
    return f"{m} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


# ----------------------------------------------------------------------------------------------
# the comparisons each script's result file supports (what BENCHMARKS.md quotes)

def _labels(runs, key="framework"):
    seen = []
    for r in runs:
        if r.get(key) not in seen:
            seen.append(r.get(key))
    return seen


def _ok_tps(r):
    return r.get("tokens_per_s") if not r.get("error") else None


def report_train_throughput(d):
    runs = d["runs"]
    labs = _labels(runs)
    peers = [p for p in ("mindformers", "torch-eager", "torch-lean", "torch-compile", "torch-lean-compile") if p in labs]
    out = []
    for n in labs:
        for p in peers:
            if n != p:
                out.append((f"tokens/s {n} / {p}", paired_stats(runs, n, p, _ok_tps)))
    # msllm-only tricks against the like-for-like run of the same file
    for trick, base in (("msllm", "msllm-dense"), ("msllm-noscale", "msllm-dense-noscale"), ("msllm", "msllm-noscale")):
        if trick in labs and base in labs:
            out.append((f"tokens/s {trick} / {base}", paired_stats(runs, trick, base, _ok_tps)))
    return out


def report_lora_speed(d):
    """Each msllm variant against its peer (transformers full, the same PEFT configuration) and each LoRA
    variant against full fine-tuning of its own kind; a ``-dense`` variant (the head at every position:
    like for like with the peers) is compared with the peers and with ``msllm-full-dense``."""
    runs, labs, out = d["runs"], _labels(d["runs"]), []
    for full in ("msllm-full", "msllm-full-dense"):
        if full in labs and "torch-full" in labs:
            out.append((f"tokens/s {full} / torch-full", paired_stats(runs, full, "torch-full", "tokens_per_s")))
    for n in labs:
        dense = n.endswith("-dense")
        if n.startswith("msllm-lora") or n.startswith("peft-lora"):
            full = ("msllm-full-dense" if dense else "msllm-full") if n.startswith("msllm") else "torch-full"
            if full in labs:
                out.append((f"tokens/s {n} / {full}", paired_stats(runs, n, full, "tokens_per_s")))
        if n.startswith("msllm-lora"):
            base = n[:-len("-dense")] if dense else n
            peft = "peft-" + base[len("msllm-"):]
            if peft in labs:
                out.append((f"tokens/s {n} / {peft}", paired_stats(runs, n, peft, "tokens_per_s")))
    return out


def report_decode_speed(d):
    runs, out = d["runs"], []
    labs = _labels(runs)
    for shape in _labels(runs, "shape"):
        for batch in sorted({r["batch"] for r in runs if r["shape"] == shape}):
            sub = [r for r in runs if r["shape"] == shape and r["batch"] == batch]
            for n in (x for x in labs if x.startswith("msllm")):
                for p in ("torch-eager", "torch-eager-passive"):
                    if not any(r["framework"] == n for r in sub) or not any(r["framework"] == p for r in sub):
                        continue
                    out.append((f"{shape} b{batch} decode tok/s {n} / {p}",
                                paired_stats(sub, n, p, "decode_tokens_per_s")))
                    out.append((f"{shape} b{batch} time to 1st token {n} / {p} (below 1: sooner)",
                                paired_stats(sub, n, p, "ttft_s")))
            if "msllm" in labs and "msllm-bf16" in labs:
                out.append((f"{shape} b{batch} decode tok/s msllm-bf16 / msllm (fp32)",
                            paired_stats(sub, "msllm-bf16", "msllm", "decode_tokens_per_s")))
    return out


def report_eval_speed(d):
    """msllm (and ``msllm-dense``, the head at every position: the like-for-like run) against the harness."""
    runs, out = d["runs"], []
    ours = [w for w in ("msllm", "msllm-dense") if w in _labels(runs, "who")]
    if "limit" in runs[0]:      # the real-model file: questions from the summary
        n = d["summary"]["msllm"]["questions"]
        cold = lambda r: n / r["cold_s"]  # noqa: E731
        warm = lambda r: n / r["warm_s"]  # noqa: E731
        for w in ours:
            out.append((f"MMLU q/s cold {w} / harness", paired_stats(runs, w, "harness", cold, label="who")))
            out.append((f"MMLU q/s warm {w} / harness", paired_stats(runs, w, "harness", warm, label="who")))
        return out
    for shape in _labels(runs, "shape"):
        for task in _labels([r for r in runs if r["shape"] == shape], "task"):
            sub = [r for r in runs if (r["shape"], r["task"]) == (shape, task)]
            for w in [w for w in ours if w in _labels(sub, "who")]:
                if "spawn_to_first_pass_end_s" in sub[0]:
                    out.append((f"{shape} {task} cold {w} / harness",
                                paired_stats(sub, w, "harness", "spawn_to_first_pass_end_s", label="who",
                                             lower_is_better=True)))
                out.append((f"{shape} {task} warm {w} / harness",
                            paired_stats(sub, w, "harness", lambda r: r["seconds"][-1], label="who",
                                         lower_is_better=True)))
    return out


def report_serve_throughput(d):
    runs = d["runs"]
    server = next(x for x in _labels(runs) if x.startswith("msllm-server"))
    return [(f"tokens/s {server} / torch-eager-generate-b8",
             paired_stats(runs, server, "torch-eager-generate-b8", "tokens_per_s")),
            ("time to 1st token: transformers / server median (above 1: server sooner)",
             stats([t / s for s, t in zip(
                 [r["ttft_median_s"] for r in runs if r["framework"] == server],
                 [r["ttft_s"] for r in runs if r["framework"] == "torch-eager-generate-b8"])]))]


def report_serve_arrivals(d):
    runs = d["runs"]
    labs = _labels(runs)
    return [(f"tokens/s {labs[0]} / {labs[1]}", paired_stats(runs, labs[0], labs[1], "tokens_per_s"))]


def report_moe(d):
    runs = d["runs"]
    labs = _labels(runs, "name")
    torch = next(x for x in labs if x.startswith("torch"))
    return [(f"tokens/s {n} / {torch}", paired_stats(runs, n, torch, "tokens_per_s", label="name"))
            for n in labs if n.startswith("msllm") and n.endswith("e8")]


def report_preprocess(d):
    runs, out = d["runs"], []
    labs = _labels(runs, "tool")
    ref = next((x for x in labs if not x.startswith("msllm")), None)
    for n in labs:
        if n == ref or ref is None:
            continue
        out.append((f"command records/s {n} / {ref}", paired_stats(runs, n, ref, "wall_s", label="tool",
                                                                   lower_is_better=True)))
        out.append((f"tokenize records/s {n} / {ref}", paired_stats(runs, n, ref, "tokenize_s", label="tool",
                                                                    lower_is_better=True)))
    return out


def report_ttft_prefill(d):
    runs, out = d["runs"], []
    for buf, prompt in sorted({(r["buffer"], r["prompt"]) for r in runs}):
        sub = [r for r in runs if (r["buffer"], r["prompt"]) == (buf, prompt)]
        out.append((f"buffer {buf} prompt {prompt}: before / after (x sooner)",
                    paired_stats(sub, "after", "before", "ttft_s", label="variant", lower_is_better=True)))
    return out


def report_dp_scaling(d):
    return [("total tokens/s 2 processes / 1",
             paired_stats(d["runs"], 2, 1, "total_tgs", label="world_size"))]


def report_recompute(d):
    runs = d["runs"]
    return [(f"tokens/s {v} / none", paired_stats(runs, v, "none", "tokens_per_s", label="variant"))
            for v in _labels(runs, "variant") if v != "none"]


def kind_of(d, path=""):
    cmd = d.get("command", "") if isinstance(d, dict) else ""
    name = os.path.basename(path)
    for k in ("train_throughput", "lora_speed", "decode_speed", "eval_speed", "serve_throughput", "serve_arrivals",
              "moe_throughput", "preprocess_speed", "preprocess_alpaca", "ttft_prefill", "dp_scaling",
              "recompute_effect"):
        if k in cmd or name.startswith(k):
            return k
    return None


REPORTS = {"train_throughput": report_train_throughput, "lora_speed": report_lora_speed,
           "decode_speed": report_decode_speed, "eval_speed": report_eval_speed,
           "serve_throughput": report_serve_throughput, "serve_arrivals": report_serve_arrivals,
           "moe_throughput": report_moe, "preprocess_speed": report_preprocess, "ttft_prefill": report_ttft_prefill,
           "dp_scaling": report_dp_scaling, "recompute_effect": report_recompute}


def report(path):
    """[(comparison, stats)] for one result file; [] for a file without paired runs."""
    try:
        with open(path) as f:
            d = json.load(f)
    except ValueError:      # a text log, not a result file
        return []
    kind = kind_of(d, path)
    if kind not in REPORTS or not isinstance(d.get("runs"), list):
        return []
    return REPORTS[kind](d)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", action="store_true", help="print the stats as JSON")
    args = ap.parse_args(argv)
    everything = {}
    for path in args.files:
        rows = report(path)
        everything[path] = {name: s for name, s in rows}
        if args.json:
            continue
        print(f"== {path}" + ("" if rows else ": no paired runs this script knows"))
        for name, s in rows:
            rounds = " / ".join(f"{x:.2f}" for x in s["rounds"])
            print(f"  {name}: {fmt(s)}   rounds: {rounds}")
    if args.json:
        json.dump(everything, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
