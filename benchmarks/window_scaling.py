"""Sliding-window attention cost against sequence length (issue #20): msllm's CPU flash kernel,
forward + backward of one attention (B 1, H 8 query / 8 key-value heads, D 64, float32, 2 threads)
at T = 1024, 2048, 4096, 8192 with the window W = 512 and without a window (causal), the two
variants timed in alternation, median of ``--repeats``. With the window each query block
multiplies only its band (``msllm/kernels/csrc/attention.cc``), so the time should grow linearly in
T beyond W (time / T flat); the causal kernel grows as T^2.

    .venv/bin/python benchmarks/window_scaling.py [--repeats 5]

Writes ``benchmarks/results/window_scaling_<machine tag>.json`` (or ``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import time

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness

common.use_repo()

LENGTHS = (1024, 2048, 4096, 8192)
WINDOW = 512
B, H, D = 1, 8, 64


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(common.ROOT, "benchmarks", "results", "window_scaling.json"))
    a = p.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor, ops

    from msllm.kernels import build, cpu_kernels

    build.build(verbose=False)
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    k = cpu_kernels()
    t0 = time.time()
    rng = np.random.default_rng(0)
    print("seed 0")
    rows = []
    for t in LENGTHS:
        q, kk, v, dy = (Tensor(rng.standard_normal((B, t, H, D)).astype(np.float32)) for _ in range(4))
        times = {"window": [], "causal": []}
        for name, w in (("window", WINDOW), ("causal", None)):   # one untimed call each (allocation)
            window = k.window_tensor(w)
            ops.grad(lambda *x: (k.flash_attention(*x, window)[0] * dy).sum(), (0, 1, 2))(q, kk, v)
        for _ in range(a.repeats):
            for name, w in (("window", WINDOW), ("causal", None)):
                window = k.window_tensor(w)
                start = time.perf_counter()
                grads = ops.grad(lambda *x: (k.flash_attention(*x, window)[0] * dy).sum(), (0, 1, 2))(q, kk, v)
                grads[0].asnumpy()
                times[name].append(time.perf_counter() - start)
        row = {"T": t, "window_s": float(np.median(times["window"])), "causal_s": float(np.median(times["causal"])),
               "window_runs": times["window"], "causal_runs": times["causal"]}
        row["window_s_per_1k_tokens"] = row["window_s"] / t * 1024
        rows.append(row)
        print(f"T {t}: window {row['window_s']:.3f} s ({row['window_s_per_1k_tokens']:.3f} s per 1k tokens), "
              f"causal {row['causal_s']:.3f} s", flush=True)
    table = ["| T | W = 512: fwd+bwd s (median) | s per 1k tokens | causal (no window) s | causal / window |",
             "|---|---|---|---|---|"]
    table += [f"| {r['T']} | {r['window_s']:.3f} | {r['window_s_per_1k_tokens']:.3f} | {r['causal_s']:.3f} | "
              f"{r['causal_s'] / r['window_s']:.1f} |" for r in rows]
    result = {"machine": common.machine(), "command": harness.command_line(), "B": B, "H": H, "D": D,
              "window": WINDOW, "repeats": a.repeats, "rows": rows}
    harness.finish(a.out, result, "\n".join(table), t0)


if __name__ == "__main__":
    main()
