"""The CPU's fp32 peak, nominal and demonstrated: the nominal figure (cores x 2 FMA units x 16
lanes x 2 FLOP x clock, ``common.cpu_fp32_peak``) and what a register-only AVX-512 FMA loop
reaches (12 independent accumulator chains per thread, enough to cover the FMA latency on both
ports), on 1 thread and on every core. The loop does nothing but FMAs, so its rate divided by
32 FLOP/cycle/core is the clock the cores actually run AVX-512 code at.

    .venv/bin/python benchmarks/cpu_peak.py [--seconds 2] [--json out.json]

Needs g++ (as msllm's kernels do). Run it on an idle machine: under load the loop gets a share
of the cores and reports less.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
static double run(long iters) {
  __m512 a[12];
  for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(1.0f + i * 1e-7f);
  const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  auto t = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) a[j] = _mm512_fmadd_ps(a[j], b, c);
  }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  float s = 0;
  for (int j = 0; j < 12; j++) s += _mm512_reduce_add_ps(a[j]);
  if (s == 12345.f) std::printf("-");
  return dt;
}
int main(int argc, char **argv) {
  int nt = std::atoi(argv[1]);
  long iters = std::atol(argv[2]);
  std::vector<double> dts(nt);
  std::vector<std::thread> th;
  for (int k = 0; k < nt; k++) th.emplace_back([&, k] { dts[k] = run(iters); });
  for (auto &t : th) t.join();
  double worst = 0;
  for (double d : dts) worst = d > worst ? d : worst;
  std::printf("%.3f\n", nt * iters * 12.0 * 16 * 2 / worst / 1e9);
}
"""


def measure(seconds: float = 2.0) -> dict:
    nominal = common.cpu_fp32_peak()
    out = {"nominal": nominal, "load_before": common.loadavg()}
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "fma.cc"), os.path.join(d, "fma")
        with open(src, "w") as fh:
            fh.write(SOURCE)
        subprocess.run(["g++", "-O2", "-mavx512f", "-std=c++17", "-pthread", src, "-o", exe], check=True)
        # ~2.6e9 cycles/s x 1 iteration (12 FMAs on 2 ports = 6 cycles) -> iterations per second
        iters = int(seconds * 4.0e8)
        for nt in sorted({1, nominal["cores"]}):
            best = max(float(subprocess.run([exe, str(nt), str(iters)], capture_output=True, text=True,
                                            check=True).stdout) for _ in range(3))
            out[f"fma_loop_gflops_{nt}_threads"] = best
            out[f"implied_clock_ghz_{nt}_threads"] = best / nt / 64.0
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
