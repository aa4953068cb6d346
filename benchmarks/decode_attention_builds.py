"""Decode attention of two builds of msllm's kernels in ONE process (issue #32): ``msllm_decode_attention``
(csrc/decode.cc) over SmolLM2-135M's 30 layers of caches (3 key/value heads of 64, 9 query heads; ``--slots``
slots of which the first ``--visible`` hold tokens; random values, seed 0), the two libraries' calls
alternating A, B, B, A, ... over ``--rounds`` rounds so the host's load hits both alike. Each library has
its own thread pool; the other's workers sleep while one runs. Before timing, the two builds' outputs must
be equal bit for bit (a kernel change that keeps the sums' order).

Per batch size and cache state: ``cold`` reads ``--evict`` MiB of another buffer before every timed pass
over the 30 layers (the state a decode step finds the caches in, after streaming the weights), ``hot``
repeats the pass over ``--hot_layers`` layers whose caches stay in the last-level cache (the kernel's
own arithmetic). Per round the median of ``--passes`` passes; the summary gives each build's median
ms and the per-round ratio B / A (``ratios.stats``).

    git worktree add /tmp/base <rev> && (cd /tmp/base && MSLLM_KERNELS_DIR=/tmp/kernels_a .venv/bin/python -m msllm.kernels.build)
    MSLLM_KERNELS_DIR=/tmp/kernels_b .venv/bin/python -m msllm.kernels.build                     # this tree
    .venv/bin/python benchmarks/decode_attention_builds.py --a /tmp/kernels_a --b /tmp/kernels_b \\
        --out benchmarks/results/decode_attention_builds_<what>_<machine>.json
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402
import ratios  # noqa: E402

H, KV, D, LAYERS = 9, 3, 64, 30   # SmolLM2-135M


def library(build_dir: str):
    path = os.path.join(build_dir, "libmsllm_kernels.so")
    if not os.path.exists(path):
        raise SystemExit(f"{path}: no kernel library there (build one with MSLLM_KERNELS_DIR={build_dir} "
                         "python -m msllm.kernels.build)")
    try:
        return ctypes.CDLL(path)
    except OSError as e:      # e.g. a build whose link path (its tree's .venv) is gone
        raise SystemExit(f"{path}: cannot be loaded ({e}); rebuild it") from None


def measure(libs: dict, batch: int, layers: int, evict_mb: int, a) -> dict:
    """{build: [ms per pass over ``layers`` layers, per round]} for one batch size and cache state."""
    from msllm.kernels import aot_args

    rng = np.random.default_rng(0)
    s = a.slots
    caches = [(rng.standard_normal((s * batch, KV, D)).astype(np.float32),
               rng.standard_normal((s * batch, KV, D)).astype(np.float32)) for _ in range(layers)]
    q = rng.standard_normal((batch, H, 1, D)).astype(np.float32)
    mask = np.zeros((batch, 1, 1, s), np.float32)
    mask[..., a.visible:] = -1e9
    outs = {k: np.zeros((layers, batch, H, 1, D), np.float32) for k in libs}
    calls = {k: [aot_args([q, kc, vc, mask, outs[k][i]]) for i, (kc, vc) in enumerate(caches)] for k in libs}
    for k, lib in libs.items():
        for args, _ in calls[k]:
            if lib.msllm_decode_attention(*args) != 0:
                raise SystemExit(f"build {k}: msllm_decode_attention refused its inputs")
    same = all(np.array_equal(outs["a"].view(np.uint32), o.view(np.uint32)) for o in outs.values())
    if not same and not a.allow_different_bits:
        raise SystemExit("the two builds' outputs differ (pass --allow_different_bits to time them anyway)")
    evict = np.ones(evict_mb << 17, np.int64) if evict_mb else None
    res: dict = {k: [] for k in libs}
    for rnd in range(a.rounds):
        for k in (("a", "b") if rnd % 2 == 0 else ("b", "a")):
            fn, ts = libs[k].msllm_decode_attention, []
            for _ in range(a.passes + 1):
                if evict is not None:
                    evict.sum()
                t0 = time.perf_counter()
                for args, _ in calls[k]:
                    fn(*args)
                ts.append(time.perf_counter() - t0)
            res[k].append(1e3 * float(np.median(ts[1:])))
    return {"ms": res, "bits_equal": same}


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--a", required=True, help="build directory A (MSLLM_KERNELS_DIR of one build)")
    p.add_argument("--b", required=True, help="build directory B")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--slots", type=int, default=544)
    p.add_argument("--visible", type=int, default=530)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--passes", type=int, default=30)
    p.add_argument("--evict", type=int, default=128, metavar="MB")
    p.add_argument("--hot_layers", type=int, default=2)
    p.add_argument("--allow_different_bits", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results", "decode_attention_builds.json"))
    a = p.parse_args(argv)
    common.use_repo()
    t0 = time.time()
    print("seed 0", flush=True)
    libs = {"a": library(a.a), "b": library(a.b)}
    cases, lines = {}, ["| batch | caches | A ms | B ms | B / A per round |", "|---|---|---|---|---|"]
    for batch in a.batches:
        for state, layers, evict in (("cold", LAYERS, a.evict), ("hot", a.hot_layers, 0)):
            r = measure(libs, batch, layers, evict, a)
            r["ratio_b_over_a"] = ratios.stats([b / x for b, x in zip(r["ms"]["b"], r["ms"]["a"])])
            cases[f"b{batch}/{state}"] = dict(r, layers=layers, evict_mb=evict)
            lines.append(f"| {batch} | {state} ({layers} layers) | {np.median(r['ms']['a']):.3f} | "
                         f"{np.median(r['ms']['b']):.3f} | {ratios.fmt(r['ratio_b_over_a'])} |")
            print(lines[-1], flush=True)
    result = {"machine": common.machine(), "command": harness.command_line(), "a": a.a, "b": a.b,
              "settings": vars(a), "cases": cases}
    harness.finish(a.out, result, "\n".join(lines), t0)


if __name__ == "__main__":
    main()
