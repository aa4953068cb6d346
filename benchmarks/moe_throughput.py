"""Mixture-of-experts training throughput (issue #22): msllm against transformers' eager
``MixtralForCausalLM`` on a Mixtral-like tiny shape (hidden 256, 4 layers, 4 heads, 8 experts of
width 688, top 2, vocab 32000, seq 256, batch 8, the load-balancing loss on), and msllm's
tokens/s for 4, 8 and 16 experts at top 2 (the grouped dropless dispatch: the cost should follow
k, not E). msllm runs its compact loss (the output head only at positions with a target);
``--dense_head`` runs msllm with the head at every position against torch on E 8 (like for like). Same random weights (one transformers Mixtral directory per expert count), the same
Alpaca batches, fp32, AdamW, one process, 2 threads; the runs alternate round by round (msllm E8,
torch E8, msllm E4, msllm E16, then the next round).

    .venv/bin/python benchmarks/moe_throughput.py [--rounds 3] [--steps 8] [--warmup 2] [--dense_head]

Reports per run tokens/s (median step after warm-up), the paired msllm / torch ratio on E = 8
(same round, median), and msllm's largest / smallest tokens/s over E = 4, 8, 16. Writes
``benchmarks/results/moe_throughput.json`` (or ``--out``) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402
import ratios  # noqa: E402

ORDER = (("msllm", "moe-tiny-e8"), ("torch", "moe-tiny-e8"), ("msllm", "moe-tiny-e4"), ("msllm", "moe-tiny-e16"))
# --dense_head: msllm with the output head at every position (like for like) against torch, E 8
DENSE_ORDER = (("msllm-dense", "moe-tiny-e8"), ("torch", "moe-tiny-e8"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=os.path.join(HERE, "results", "moe_throughput.json"))
    p.add_argument("--dense_head", action="store_true", help="msllm-dense (head at every position) vs torch, E 8")
    a = p.parse_args(argv)
    order = DENSE_ORDER if a.dense_head else ORDER
    t0 = time.time()
    for _, shape in order:
        common.moe_hf_dir(shape)   # made once, before any timing
    runs = []
    for rnd in range(a.rounds):
        for fw, shape in order:
            extra = {"framework": "msllm", "dense_head": True} if fw == "msllm-dense" else {"framework": fw}
            r = harness.run_worker(f"{fw}-{shape}", "moe_worker.py", {"shape": shape, **extra,
                                   "steps": a.steps, "warmup": a.warmup}, a.timeout)
            r.update(round=rnd, name=f"{fw} {shape}")
            harness.log_run(runs, r, f"round {rnd} {fw} {shape}",
                            lambda x: f"{x['tokens_per_s']:.1f} tok/s (first step {x['first_step_s']:.1f} s, "
                                      f"load {x['load_before']})")
    table = {}
    for fw, shape in order:
        ok = [r for r in runs if r.get("name") == f"{fw} {shape}" and "error" not in r]
        bad = [r["error"] for r in runs if r.get("name") == f"{fw} {shape}" and "error" in r]
        if not ok:
            table[f"{fw} {shape}"] = {"error": bad[0] if bad else "no run"}
            continue
        tps = [r["tokens_per_s"] for r in ok]
        table[f"{fw} {shape}"] = {"runs": len(ok), "tokens_per_s": common.median(tps), "tokens_per_s_all": tps,
                                  "step_s": common.median([r["step_s_median"] for r in ok]),
                                  "first_step_s": ok[0]["first_step_s"],
                                  "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
                                  "loss_first": ok[0]["losses"][0]}
    paired = []
    mine = "msllm-dense moe-tiny-e8" if a.dense_head else "msllm moe-tiny-e8"
    for rnd in range(a.rounds):
        got = {r["name"]: r for r in runs if r["round"] == rnd and "error" not in r}
        if mine in got and "torch moe-tiny-e8" in got:
            paired.append(got[mine]["tokens_per_s"] / got["torch moe-tiny-e8"]["tokens_per_s"])
    scan = [table.get(f"msllm moe-tiny-e{e}", {}).get("tokens_per_s") for e in (4, 8, 16)]
    summary = {"ratio_msllm_vs_torch_eager_e8": common.median(paired) if paired else None,
               "ratio_msllm_vs_torch_eager_e8_all": paired,
               "msllm_tokens_per_s_e4_e8_e16": scan,
               "msllm_max_over_min_e4_e8_e16": (max(scan) / min(scan)) if all(scan) else None,
               "msllm_run_compared": mine}
    result = {"machine": common.machine(), "command": harness.command_line(), "rounds": a.rounds,
              "steps": a.steps, "warmup": a.warmup, "table": table, "summary": summary, "runs": runs}
    lines = ["| run | tokens/s (median) | all rounds | step s | first step s | peak RSS MiB |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += harness.md_rows(table, lambda n, r: f"| {n} | {r['tokens_per_s']:.1f} | "
                             f"{', '.join(f'{x:.1f}' for x in r['tokens_per_s_all'])} | {r['step_s']:.3f} | "
                             f"{r['first_step_s']:.1f} | {r['peak_rss_mib']:.0f} |")
    lines.append(f"\nmsllm / torch eager (E 8, median (min-max) of the paired rounds): {ratios.fmt(ratios.stats(paired))}; "
                 f"msllm E 4 / 8 / 16: {scan}, max / min {summary['msllm_max_over_min_e4_e8_e16']}")
    harness.finish(a.out, result, "\n".join(lines), t0)


if __name__ == "__main__":
    main()
