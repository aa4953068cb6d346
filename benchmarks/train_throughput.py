"""Training throughput, side by side: msllm vs MindFormers 1.9.0 vs PyTorch (HF transformers and a
lean LLaMA, each eager and under torch.compile) on the same LLaMA shapes, the same initial
weights and the same real batches (bundled Alpaca records, msllm preprocessing, LLaMA
tokenizer), fp32, AdamW, one process, 2 CPU threads.

Each framework runs in its own subprocess (MindFormers in ``benchmarks/.venv-mindformers``,
made by ``benchmarks/setup_mindformers.sh``), and the runs alternate round by round (msllm,
msllm-dense, torch-eager, torch-lean, torch-compile, torch-lean-compile, mindformers, then the
next round), so the machine's background load hits all of them alike. Matmul peaks (MindSpore,
torch, numpy) are measured in the same invocation, before and after the runs.

    .venv/bin/python benchmarks/train_throughput.py --shape tiny       # ~15 min idle
    .venv/bin/python benchmarks/train_throughput.py --shape medium     # ~20 min
    .venv/bin/python benchmarks/train_throughput.py --shape large      # ~35 min
    .venv/bin/python benchmarks/train_throughput.py --shape medium-qwen2 --frameworks msllm,torch-eager,torch-compile
    (medium-mistral likewise: the LLaMA family's other members, issue #20)

Reports per framework: tokens/s (median over rounds of each run's median step time after
warm-up), step time, process CPU seconds per step, first step (compile) time, start-up to end of
first step (process spawn -> first loss), import time, peak RSS (VmHWM of the worker), the
paired ratios (same round, median) to MindFormers and to each PyTorch peer, and MFU = tokens/s x
(6N + 12LHDT) FLOPs/token (PaLM, appendix B) over (a) the CPU's fp32 peak as msllm's trainer
computes it (cores x FMA units x lanes x 2 x the vector clock the kernels' FMA loop measured,
``common.cpu_fp32_peak``), (b) the same at the clock the CPU describes (/proc/cpuinfo), (c) the
best matmul rate measured in the run. ``msllm`` uses the
compact loss (head on target positions only: less work than 6N counts); ``msllm-dense`` does the
same work as the others. Losses: every framework starts from the same weights and sees the same
batches; msllm ``noscale`` (no loss scale, no clipping) does exactly MindFormers' and PyTorch's
update, so the first losses are compared (max |diff| vs MindFormers, torch eager, torch lean).

Writes ``benchmarks/results/train_throughput_<shape>.json`` and prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from ratios import fmt as fmt_ratio, stats as ratio_stats  # noqa: E402
import harness  # noqa: E402

WORKERS = {
    "msllm": ("main", "msllm_worker.py", {"variant": "default"}),
    "msllm-noscale": ("main", "msllm_worker.py", {"variant": "noscale"}),
    "msllm-dense": ("main", "msllm_worker.py", {"variant": "default", "compact_loss": False,
                                                "name": "msllm-dense"}),
    # the same update as the PyTorch peers and the same work (dense head, no loss scale, no clipping)
    "msllm-dense-noscale": ("main", "msllm_worker.py", {"variant": "noscale", "compact_loss": False,
                                                        "name": "msllm-dense-noscale"}),
    "mindformers": ("mf", "mf_worker.py", {}),
    # a CPU without AVX-512, on this machine (common.AVX2_ENV): msllm's kernels built for haswell and oneDNN
    # capped at AVX2; MindFormers with oneDNN capped at AVX2 (its nnacl kernels choose from the CPU's flags)
    "msllm-avx2": ("main", "msllm_worker.py", {"variant": "default", "name": "msllm-avx2"}),
    "mindformers-avx2": ("mf", "mf_worker.py", {"name": "mindformers-avx2"}),
    "torch-eager": ("main", "torch_worker.py", {"compile": False}),
    "torch-compile": ("main", "torch_worker.py", {"compile": True}),
    "torch-lean": ("main", "torch_worker.py", {"compile": False, "model": "lean", "name": "torch-lean"}),
    "torch-lean-compile": ("main", "torch_worker.py", {"compile": True, "model": "lean",
                                                        "name": "torch-lean-compile"}),
}
# the PyTorch peers msllm is compared with (paired ratios in the same round)
TORCH_PEERS = ("torch-eager", "torch-lean", "torch-compile", "torch-lean-compile")
# further paired ratios (same round) printed in the result: the AVX2 runs against each other and against native
OTHER_PEERS = ("mindformers-avx2", "msllm")


def worker_env(name: str) -> dict:
    """Environment of the ``-avx2`` workers (the kernel library built first for msllm's)."""
    if name == "msllm-avx2":
        return common.isa_env("avx2")
    if name == "mindformers-avx2":
        return {"ONEDNN_MAX_CPU_ISA": common.AVX2_ENV["ONEDNN_MAX_CPU_ISA"]}
    return {}
# (measured steps in round 0, in later rounds, warm-up steps): round 0 gives 20 (tiny) / 10
# (medium) losses per framework for the loss comparison, later rounds only throughput.
DEFAULT_STEPS = {"tiny": (18, 10, 2), "medium": (6, 4, 2), "large": (4, 3, 2), "medium-qwen2": (6, 4, 2),
                 "medium-mistral": (6, 4, 2)}
# frameworks run only in round 0 (msllm-noscale: its losses are what is compared with
# MindFormers'); medium steps are ~4x longer, so there only msllm, MindFormers and torch eager
# are repeated
ONCE = {"tiny": ("msllm-noscale",), "medium": ("msllm-noscale",), "large": ("msllm-noscale",),
        "medium-qwen2": ("msllm-noscale",), "medium-mistral": ("msllm-noscale",)}


def run_worker(name: str, shape: str, steps: int, warmup: int, timeout: float, extra: dict,
               env_extra: dict | None = None) -> dict:
    """One run of framework ``name`` (see :data:`WORKERS`), in its own interpreter."""
    venv, script, kw = WORKERS[name]
    return harness.run_worker(name, script, {"shape": shape, "steps": steps, "warmup": warmup, **kw, **extra},
                             timeout, common.MAIN_PY if venv == "main" else common.MF_PY, env_extra)


def measure_peaks() -> dict:
    """fp32 matmul GFLOP/s of MindSpore, torch and numpy, each in its own process (torch's
    OpenMP threads keep spinning after a matmul and would slow a MindSpore matmul after it)."""
    out = {"load": common.loadavg()}
    for lib in ("mindspore", "torch", "numpy"):
        r = harness.run_worker(f"peak-{lib}", "peak_worker.py", {"repeats": 10, "which": [lib]}, 600)
        if "error" in r:
            out[f"{lib}_error"] = r["error"][-1000:]
        else:
            out.update({k: v for k, v in r.items()
                        if k not in ("load", "framework", "wall_s", "load_before", "load_after")})
    return out


def target_share(s: dict, run: dict) -> float:
    """Mean share of positions with a target over the batches ``run`` timed (after its warm-up):
    where msllm's compact loss runs the output head."""
    n = len(run["step_s_all"])
    batches = common.batches(common.data_file(s["seq_length"]), s["batch_size"], n)[run.get("warmup", 2):]
    return float(common.np.mean([(lab[:, 1:] != -100).mean() for _, lab in batches]))


def summarise(shape: str, runs: list[dict], peaks: list[dict], cpu_peak: dict | None = None) -> dict:
    s = common.shape(shape)
    fpt = common.flops_per_token(s)
    head = 6.0 * s["vocab_size"] * s["hidden_size"]  # the output head's FLOPs per token (fwd + 2 bwd)
    cpu_peak = cpu_peak or common.cpu_fp32_peak()
    best = {}
    for key in ("mindspore_gflops", "torch_gflops", "numpy_gflops"):
        vals = [p[key] for p in peaks if key in p]
        best[key] = max(vals) if vals else None
    names = list(dict.fromkeys(r["framework"] for r in runs))
    table = {}
    for n in names:
        ok, error = harness.ok_runs(runs, n)
        if not ok:
            table[n] = {"error": error}
            continue
        tps = [r["tokens_per_s"] for r in ok]
        cold = [r for r in ok if r["round"] == 0] or ok  # compile / start-up: the cold (first) run
        best_step = min(min(r["step_s_all"][-(len(r["step_s_all"]) - r.get("warmup", 2)):]) for r in ok)
        row = {
            "runs": len(ok), "tokens_per_s": common.median(tps), "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps), "step_s": common.median([r["step_s_median"] for r in ok]),
            "best_step_s": best_step,
            "tokens_per_s_best_step": s["batch_size"] * s["seq_length"] / best_step,
            "cpu_s_per_step": common.median([r["cpu_s_median"] for r in ok]),
            "first_step_s": common.median([r["first_step_s"] for r in cold]),
            "startup_to_first_step_s": common.median([r["startup_to_first_step_s"] for r in cold]),
            "first_step_s_later_rounds": [r["first_step_s"] for r in ok if r["round"] > 0],
            "import_s": common.median([r["import_s"] for r in ok]),
            "build_s": common.median([r["build_s"] for r in ok]),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
            "loads": [r["load_before"] for r in ok],
        }
        row["tokens_per_cpu_s"] = s["batch_size"] * s["seq_length"] / row["cpu_s_per_step"]
        # MFU against the machine's best demonstrated fp32 GEMM rate (the max over MindSpore,
        # torch and numpy: torch's GEMM is the fastest here), and against MindSpore's own MatMul
        top = max([v for v in best.values() if v] or [0])
        if top:
            row["mfu"] = row["tokens_per_s"] * fpt / (top * 1e9)
        if best["mindspore_gflops"]:
            row["mfu_vs_ms_peak"] = row["tokens_per_s"] * fpt / (best["mindspore_gflops"] * 1e9)
        # MFU against the CPU's fp32 peak as the trainer computes it (cores x FMA units x lanes x 2
        # x the measured vector clock), and against the same at the clock the CPU describes
        row["mfu_cpu_peak"] = row["tokens_per_s"] * fpt / (cpu_peak["gflops"] * 1e9)
        row["mfu_cpu_peak_described"] = row["tokens_per_s"] * fpt / (cpu_peak["gflops_described"] * 1e9)
        # FLOPs the step executes: the compact loss runs the head only at target positions (as
        # msllm's trainer counts MFU); the same as above for every dense run
        share = common.median([target_share(s, r) for r in ok]) if any(r.get("compact_loss") for r in ok) else 1.0
        row["head_share"] = share
        # HFU (FLOPs executed), msllm's kernels only: the head at target positions, the attention as
        # its CPU flash kernel runs it (causal query blocks, scores recomputed in the backward pass);
        # the peers' kernels are not modelled, so their rows keep the model count
        fast = n.startswith("msllm")   # every msllm variant here runs its CPU kernels (flash attention)
        executed = fpt - head * (1.0 - share)
        if fast:
            from msllm.training.throughput import FLASH_EXECUTED_PER_MODEL, causal_block_fraction, flash_block_rows

            t = s["seq_length"]
            attn = 12.0 * s["num_layers"] * s["num_heads"] * (s["hidden_size"] // s["num_heads"]) * t
            executed += attn * (FLASH_EXECUTED_PER_MODEL * causal_block_fraction(t, flash_block_rows(t)) - 1.0)
        row["hfu_cpu_peak"] = row["tokens_per_s"] * executed / (cpu_peak["gflops"] * 1e9) if fast else None
        row.pop("mfu_cpu_peak_executed", None)
        table[n] = row
    # paired ratios: run i of X / run i of MindFormers (same round)
    by_round: dict[int, dict[str, dict]] = {}
    for r in runs:
        if "error" not in r:
            by_round.setdefault(r["round"], {})[r["framework"]] = r
    for n in names:
        if n == "mindformers" or "error" in table.get(n, {}):
            continue
        ratios = [rd[n]["tokens_per_s"] / rd["mindformers"]["tokens_per_s"]
                  for rd in by_round.values() if n in rd and "mindformers" in rd]
        cpu_ratios = [rd["mindformers"]["cpu_s_median"] / rd[n]["cpu_s_median"]
                      for rd in by_round.values() if n in rd and "mindformers" in rd]
        if "mindformers" in table and "error" not in table["mindformers"]:
            table[n]["best_step_ratio_vs_mindformers"] = (table["mindformers"]["best_step_s"]
                                                          / table[n]["best_step_s"])
        if ratios:
            table[n]["ratio_vs_mindformers"] = common.median(ratios)
            table[n]["ratio_vs_mindformers_all"] = ratios
            table[n]["cpu_ratio_vs_mindformers"] = common.median(cpu_ratios)
    for n in names:
        if "error" in table.get(n, {}):
            continue
        for peer in TORCH_PEERS + OTHER_PEERS:
            paired = [rd[n]["tokens_per_s"] / rd[peer]["tokens_per_s"]
                      for rd in by_round.values() if n in rd and peer in rd and n != peer]
            if paired:
                table[n][f"ratio_vs_{peer}"] = common.median(paired)
                table[n][f"ratio_vs_{peer}_all"] = paired
    # loss agreement (first round of each framework)
    first = {}
    for r in runs:
        if "error" not in r and r["framework"] not in first:
            first[r["framework"]] = r["losses"]
    loss_cmp = {}
    for peer in ("torch-eager", "torch-lean"):
        ref = first.get(peer)
        if ref:
            for n, l in first.items():
                if n != peer:
                    k = min(len(l), len(ref))
                    loss_cmp.setdefault(n, {})[f"max_abs_diff_vs_{peer}"] = max(abs(a - b) for a, b in
                                                                               zip(l[:k], ref[:k]))
    ref = first.get("mindformers")
    if ref:
        for n, l in first.items():
            if n != "mindformers":
                k = min(len(l), len(ref))
                loss_cmp.setdefault(n, {}).update(
                    steps=k, max_abs_diff=max(abs(a - b) for a, b in zip(l[:k], ref[:k])), first_loss=l[0],
                    last_loss=l[k - 1])
        loss_cmp.setdefault("mindformers", {}).update(steps=len(ref), first_loss=ref[0], last_loss=ref[-1])
    for n, l in first.items():
        loss_cmp.setdefault(n, {}).setdefault("steps", len(l))
        loss_cmp[n].setdefault("first_loss", l[0])
        loss_cmp[n].setdefault("last_loss", l[-1])
    return {"shape": shape, "shape_params": s, "flops_per_token": fpt, "params": common.num_params(s),
            "best_peaks_gflops": best, "cpu_fp32_peak": cpu_peak, "frameworks": table, "losses": loss_cmp}


def markdown(summary: dict) -> str:
    p = summary["best_peaks_gflops"]
    cp = summary["cpu_fp32_peak"]
    lines = [f"Shape `{summary['shape']}` {summary['shape_params']}, {summary['params'] / 1e6:.2f}M params, "
             f"{summary['flops_per_token'] / 1e6:.1f} MFLOP/token; best fp32 matmul 2048^3 in this run: "
             f"MindSpore {p['mindspore_gflops'] or 0:.0f}, torch {p['torch_gflops'] or 0:.0f}, "
             f"numpy {p['numpy_gflops'] or 0:.0f} GFLOP/s; CPU fp32 peak {cp['gflops']:.1f} GFLOP/s "
             f"({cp['cores']} cores x {cp['fma_units']} FMA x {cp['lanes']} lanes x 2 x {cp['clock_ghz']} GHz from "
             f"{cp['clock_source']}; {cp['gflops_described']:.1f} at the described {cp['described_clock_ghz']} GHz)", "",
             "| framework | tokens/s (median, min-max) | step s | CPU s/step | x MindFormers (paired) "
             "| x torch eager | x torch lean | x torch.compile | x lean compile | first step s "
             "| spawn->1st loss s | peak RSS MiB | MFU (CPU peak) | HFU (CPU peak) | MFU (described clock) "
             "| MFU (best GEMM) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(n, r):
        def ratio(key):   # the median (min-max) of the per-round paired ratios
            return fmt_ratio(ratio_stats(r[key + "_all"])) if key + "_all" in r else "-"

        hfu = "-" if r.get("hfu_cpu_peak") is None else f"{100 * r['hfu_cpu_peak']:.1f}%"
        return (
            f"| {n} | {r['tokens_per_s']:.0f} ({r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}) "
            f"| {r['step_s']:.2f} | {r['cpu_s_per_step']:.2f} | {ratio('ratio_vs_mindformers')} "
            f"| {ratio('ratio_vs_torch-eager')} | {ratio('ratio_vs_torch-lean')} | {ratio('ratio_vs_torch-compile')} "
            f"| {ratio('ratio_vs_torch-lean-compile')} | {r['first_step_s']:.1f} | {r['startup_to_first_step_s']:.1f} "
            f"| {r['peak_rss_mib']:.0f} | {100 * r['mfu_cpu_peak']:.1f}% | "
            f"{hfu} "
            f"| {100 * r['mfu_cpu_peak_described']:.1f}% "
            f"| {100 * r.get('mfu', 0):.1f}% |")

    lines += harness.md_rows(summary["frameworks"], row)
    if summary["losses"]:
        lines += ["", "| framework | losses compared | first loss | last loss | max abs diff vs MindFormers "
                  "| vs torch eager | vs torch lean |", "|---|---|---|---|---|---|---|"]

        def diff(c, key):
            return f"{c[key]:.2e}" if key in c else "-"

        for n, c in summary["losses"].items():
            lines.append(f"| {n} | {c['steps']} | {c['first_loss']:.6f} | {c['last_loss']:.6f} "
                         f"| {diff(c, 'max_abs_diff')} | {diff(c, 'max_abs_diff_vs_torch-eager')} "
                         f"| {diff(c, 'max_abs_diff_vs_torch-lean')} |")
    return "\n".join(lines)


def main(argv=None):
    p = harness.arg_parser(__doc__, "tiny")
    p.add_argument("--frameworks",
                   default="msllm,msllm-dense,torch-eager,torch-lean,torch-compile,torch-lean-compile,mindformers,"
                           "msllm-noscale")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="measured steps per run in round 0 (tiny 18, medium 8)")
    p.add_argument("--steps_later", type=int, default=None, help="measured steps in later rounds (tiny 10, medium 5)")
    p.add_argument("--warmup", type=int, default=None, help="steps not measured (the first compiles)")
    p.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    p.add_argument("--extra", default="{}", help="JSON merged into every worker's arguments")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/...)")
    p.add_argument("--resummarise", default=None, metavar="JSON",
                   help="recompute the summary of a result file from its raw runs and peaks (no new runs)")
    a = p.parse_args(argv)
    if a.resummarise:
        old = json.load(open(a.resummarise))
        summary = summarise(old["shape"], old["runs"], old["peaks"], old.get("cpu_fp32_peak"))
        summary.update({k: old[k] for k in ("machine", "command", "steps", "warmup", "rounds", "total_seconds",
                                            "extra", "peaks", "runs") if k in old})
        summary["resummarised_by"] = harness.command_line()
        harness.finish(a.resummarise, summary, markdown(summary), time.time())
        return
    steps, steps_later, warmup = DEFAULT_STEPS[a.shape]
    steps = a.steps or steps
    steps_later = a.steps_later or steps_later
    warmup = a.warmup if a.warmup is not None else warmup
    names = [n.strip() for n in a.frameworks.split(",") if n.strip()]
    for n in names:
        if n not in WORKERS:
            p.error(f"unknown framework {n!r}; expected some of {', '.join(WORKERS)}")
    if any(n.startswith("mindformers") for n in names) and not os.path.exists(common.MF_PY):
        sys.exit(f"{common.MF_PY} missing: run bash benchmarks/setup_mindformers.sh first")
    s = common.shape(a.shape)
    info = common.machine()
    print(f"# {info}\n# shape {a.shape}: {s}; {steps} measured steps after {warmup} warm-up; "
          f"{a.rounds} rounds of {names}", flush=True)
    common.prepare_data(s["seq_length"])
    common.prepare_weights(a.shape)
    extra = json.loads(a.extra)
    t0 = time.time()
    peaks = [measure_peaks()]
    print(f"peaks: {peaks[-1]}", flush=True)
    runs = []
    envs = {n: worker_env(n) for n in names}
    # one torch.compile cache per invocation: round 0 compiles cold, later rounds find the cache
    inductor_cache = tempfile.mkdtemp(prefix="bench_inductor_")
    for rnd in range(a.rounds):
        for n in names:
            if rnd > 0 and n in ONCE[a.shape]:
                continue
            r = run_worker(n, a.shape, steps if rnd == 0 else steps_later, warmup, a.timeout, extra,
                           {"TORCHINDUCTOR_CACHE_DIR": inductor_cache, **envs[n]})
            r["round"], r["warmup"] = rnd, warmup
            harness.log_run(runs, r, f"round {rnd} {n:14s}", lambda r: (
                f"{r['tokens_per_s']:7.0f} tok/s  step {r['step_s_median']:.2f} s "
                f"cpu {r['cpu_s_median']:.2f} s  first {r['first_step_s']:.1f} s  spawn->1st "
                f"{r['startup_to_first_step_s']:.1f} s  import {r['import_s']:.1f} s  "
                f"RSS {r['peak_rss_mib']:.0f} MiB  load {r['load_before']} -> {r['load_after']}"))
        peaks.append(measure_peaks())
        print(f"peaks: {peaks[-1]}", flush=True)
    shutil.rmtree(inductor_cache, ignore_errors=True)
    summary = summarise(a.shape, runs, peaks)
    summary.update(machine=info, command=harness.command_line(), steps=steps, warmup=warmup, rounds=a.rounds,
                   total_seconds=time.time() - t0, extra=extra, peaks=peaks, runs=runs,
                   worker_env={n: e for n, e in envs.items() if e},
                   kernel_builds={n: common.kernel_build(e) for n, e in envs.items() if n.startswith("msllm")})
    harness.finish(a.out or os.path.join(HERE, "results", f"train_throughput_{a.shape}.json"), summary,
                  markdown(summary), t0)


if __name__ == "__main__":
    main()
