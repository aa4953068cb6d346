"""Read bandwidth of batch-1 matrix-vector products over SmolLM2-135M's float32 weight set on 2
threads, outside any framework (issue #32: why msllm's decode kernels read ~15 GB/s where the
floor's 1 GiB ``torch.mv`` reads ~30). Compiles ``weight_stream_bandwidth.cc`` (g++ -O3
-march=native: AVX-512 vectors, or AVX2 + FMA ones on a CPU without AVX-512) into ``benchmarks/.cache`` and runs
each variant once per round, the variants in alternating order, ``--passes`` passes over the
538 MB each (the first not counted); per variant the median over rounds of the best pass.

Variants (the .cc file's header): how a product's rows are split between the 2 threads (msllm's
dynamic 64 KiB chunks / contiguous halves / a plain read), rows per inner loop (2 / 8), the
barrier between products (futex: a waiting thread sleeps, as a thread pool that parks its
workers between a framework's operators; spin), and the pages (4 KiB / 2 MiB transparent huge
pages, ``madvise(MADV_HUGEPAGE)`` on one arena).

    .venv/bin/python benchmarks/weight_stream_bandwidth.py --rounds 3 \\
        --out benchmarks/results/weight_stream_bandwidth_intel_xeon.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402

VARIANTS = [  # (split, rows, barrier, pages)
    ("dynamic", 2, "futex", "small"),    # msllm's gemv as it was: chunks, 2 rows, workers parked
    ("dynamic", 2, "futex", "huge"),
    ("dynamic", 2, "spin", "small"),
    ("dynamic", 2, "spin", "huge"),
    ("halves", 8, "spin", "huge"),
    ("halves", 2, "spin", "huge"),       # msllm's split since 2026-11-29 (contiguous shares), 2 rows
    ("dynamic", 8, "spin", "huge"),
    ("read", 0, "futex", "small"),
    ("read", 0, "spin", "huge"),
]


def build() -> str:
    return common.build_cached("weight_stream_bandwidth.cc", "weight_stream_bandwidth",
                               ["g++", "-O3", "-march=native", "-std=c++20", "-pthread"])


# The variant llamacpp_speed.py --bandwidth_probe runs beside each decode measurement: the fastest in this file's runs
# on the AMD EPYC Zen 5 (weight_stream_bandwidth_amd_zen5.json) and the Intel Xeon.
PROBE = ("halves", 2, "spin", "huge")


def run_variant(exe: str, variant: tuple = PROBE, passes: int = 8) -> list[float]:
    """GB/s of each pass after the first (the first touches the pages) of one run of ``variant``."""
    split, rows, barrier, pages = variant
    res = subprocess.run([exe, split, str(rows or 2), barrier, pages, str(passes)], capture_output=True, text=True,
                         check=True)
    return [float(line.split()[-1]) for line in res.stdout.splitlines() if line.startswith("pass")][1:]


def probe(exe: str, passes: int = 8) -> dict:
    """One run of :data:`PROBE`: {"variant", "gb_s_best", "gb_s_median", "gb_s_passes"} (what a floor measured in the
    same minute as a decode step divides by: llamacpp_speed.py --bandwidth_probe, decode_floor.py)."""
    gbs = run_variant(exe, PROBE, passes)
    return {"variant": "/".join(map(str, PROBE)), "gb_s_best": max(gbs), "gb_s_median": statistics.median(gbs),
            "gb_s_passes": gbs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=8)
    p.add_argument("--only", nargs="+", default=None, metavar="SPLIT/ROWS/BARRIER/PAGES",
                   help="run these variants only (names as printed)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "weight_stream_bandwidth.json"))
    a = p.parse_args(argv)
    exe = build()
    named = {"/".join(map(str, v)): v for v in VARIANTS}
    runs: dict = {k: [] for k in named if a.only is None or k in a.only}
    if not runs:
        raise SystemExit(f"--only {a.only}: none of {list(named)}")
    for r in range(a.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for k in order:
            v = named[k]
            gbs = run_variant(exe, v, a.passes)
            runs[k].append(max(gbs))
            print(f"round {r} {v}: best {max(gbs):.1f} GB/s", flush=True)
    summary = {k: statistics.median(x) for k, x in runs.items()}
    doc = {"benchmark": "weight_stream_bandwidth", "machine": common.machine(), "command": harness.command_line(),
           "weights_mb": 537.9, "threads": 2,
           "variants": "split/rows/barrier/pages (weight_stream_bandwidth.cc)", "rounds": a.rounds,
           "passes": a.passes, "gb_s_median_of_best_pass": summary, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    for k, v in summary.items():
        print(f"{k}: {v:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
