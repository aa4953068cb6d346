"""Work per training step on ONE core: every framework runs with one thread (MindSpore
``runtime_num_threads=1`` and ``MSLLM_KERNEL_THREADS=1``, torch ``set_num_threads(1)``), and the
figure is the process CPU seconds of a step (the minimum over the measured steps). With one
thread there is no spinning and no waiting for a second thread, so the CPU time is the work
the framework does; on a machine shared with other jobs it moves far less than wall time
(other processes take wall time, not this process's CPU time). It complements, and does not
replace, the 2-core wall-clock comparison of ``train_throughput.py``: parallel efficiency is
not measured here.

    .venv/bin/python benchmarks/single_core.py --shape medium [--rounds 2] [--steps 3]

Runs alternate framework by framework within each round. Writes
``benchmarks/results/single_core_<shape>.json`` and prints ratios to torch eager / lean.
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402
import train_throughput as tt  # noqa: E402

VARIANTS = {
    "msllm": ("msllm", {}),
    "msllm-dense": ("msllm-dense", {}),
    "msllm-composed": ("msllm", {"model_config": {"cpu_kernels": False}, "name": "msllm-composed"}),
    "torch-eager": ("torch-eager", {}),
    "torch-lean": ("torch-lean", {}),
}


def main(argv=None):
    p = harness.arg_parser(__doc__, "medium")
    p.add_argument("--frameworks", default="msllm,msllm-dense,msllm-composed,torch-eager,torch-lean")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    s = common.shape(a.shape)
    common.prepare_data(s["seq_length"])
    common.prepare_weights(a.shape)
    env = {"MSLLM_KERNEL_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    runs = []
    t0 = time.time()
    for rnd in range(a.rounds):
        for name in a.frameworks.split(","):
            worker, extra = VARIANTS[name]
            r = tt.run_worker(worker, a.shape, a.steps, a.warmup, 3600, {"threads": 1, **extra}, env)
            r["variant"], r["round"] = name, rnd
            harness.log_run(runs, r, f"round {rnd} {name:15s}", lambda r: (
                f"min CPU s/step {min(r['cpu_s_all'][a.warmup:]):7.2f}  (wall median {r['step_s_median']:.2f} s) "
                f"load {r['load_before']}"))
    best = {}
    for r in runs:
        if "error" not in r:
            cpu = min(r["cpu_s_all"][a.warmup:])
            best[r["variant"]] = min(best.get(r["variant"], float("inf")), cpu)
    tokens = s["batch_size"] * s["seq_length"]
    fpt = common.flops_per_token(s)
    print(f"\n| framework | min CPU s/step (1 thread) | tokens per CPU-s | GFLOP per CPU-s (6N+12LHDT) "
          f"| x torch eager | x torch lean |\n|---|---|---|---|---|---|")
    for n, c in best.items():
        te, tl = best.get("torch-eager"), best.get("torch-lean")
        print(f"| {n} | {c:.2f} | {tokens / c:.0f} | {tokens * fpt / c / 1e9:.0f} "
              f"| {te / c if te else float('nan'):.2f} | {tl / c if tl else float('nan'):.2f} |")
    out = a.out or os.path.join(HERE, "results", f"single_core_{a.shape}.json")
    harness.write_json(out, {"shape": a.shape, "machine": common.machine(), "best_cpu_s_per_step": best, "runs": runs,
                            "seconds": time.time() - t0, "command": harness.command_line()})
    print(f"results in {out}")


if __name__ == "__main__":
    main()
