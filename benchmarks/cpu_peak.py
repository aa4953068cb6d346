"""The CPU's fp32 peak, as msllm's trainer computes it and as demonstrated: the figure of
``msllm.training.throughput.host_cpu_peak`` (cores x FMA units x lanes x 2 x clock; the clock the
CPU describes, or the measured one when higher), the same at the described clock, and what the
register-only FMA loop of msllm's kernels (``msllm/kernels/csrc/peak.cc``: independent FMA chains,
no memory traffic) reaches on 1 thread and on every core. The loop does nothing but FMAs, so its
rate per core divided by FMA units x lanes x 2 is the clock the cores run vector code at.

    .venv/bin/python benchmarks/cpu_peak.py [--seconds 2] [--json out.json]

Needs msllm's kernels built (make install). Run it on an idle machine: under load the loop gets a
share of the cores and reports less.
"""

from __future__ import annotations

import json

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness


def measure(seconds: float = 2.0) -> dict:
    import tempfile

    from msllm.kernels.clock_probe import compile_probe, measure_fma_loop

    peak = common.cpu_fp32_peak()
    out = {"peak": peak, "load_before": common.loadavg()}
    per_cycle = peak["fma_units"] * peak["lanes"] * 2
    with tempfile.TemporaryDirectory() as tmp:
        lib = compile_probe(tmp)
        for nt in sorted({1, peak["cores"]}):
            r = measure_fma_loop(lib, threads=nt, seconds=seconds)
            out[f"fma_loop_gflops_{nt}_threads"] = r["gflops"]
            out[f"implied_clock_ghz_{nt}_threads"] = r["gflops"] / nt / per_cycle
    out["load_after"] = common.loadavg()
    return out


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    r = measure(a.seconds)
    print(json.dumps(r, indent=1))
    if a.json:
        harness.write_json(a.json, r)


if __name__ == "__main__":
    main()
