"""Read bandwidth of msllm's weight-streaming products with and without their software prefetch (issue #32),
outside any framework: ``msllm_linear`` (float32, bfloat16 weights) and ``msllm_linear_int8`` (int8, one scale
per row) called through ctypes over SmolLM2-135M's decoder weight shapes (30 layers x q, k, v, o, gate, up,
down), every product once per pass, on 2 threads; GB/s = weight bytes per pass / pass time.

Each ISA runs in a child process of its own: ``native`` (this machine's library: the AVX-512 path on an
AVX-512 CPU) and ``avx2`` (``common.isa_env('avx2')``: the library built for haswell, its AVX2 paths). In a
child, every round times each (weight type, rows of x, ``MSLLM_GEMV_PREFETCH`` distance into L1,
``MSLLM_GEMV_PREFETCH_FAR`` distance into L2) once, the distances in alternating order (the kernels read the
variables per product), ``--passes`` passes each (the first not counted); per setting the median over rounds
of the median pass. ``--far`` defaults to the kernels' own 32768 (result files from before it have no
``far=`` in their keys: the kernels then had no second prefetch).

    .venv/bin/python benchmarks/gemv_prefetch.py --rounds 3 --distances 8192 --far 0 32768 --rows 1 \
        --out benchmarks/results/gemv_prefetch_far_intel_xeon.json

    .venv/bin/python benchmarks/gemv_prefetch.py --rounds 3 --out benchmarks/results/gemv_prefetch_intel_xeon.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "kernels"))   # kerneltest_helpers.aot_args
import common  # noqa: E402
import harness  # noqa: E402

# SmolLM2-135M's decoder products (out, in) per layer
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS = 30


def child(spec: dict) -> dict:
    """Runs in the ISA's process: {key: [GB/s per round]} for the settings of ``spec``."""
    import ctypes

    import numpy as np
    from kerneltest_helpers import aot_args   # the kernel tests' argument marshalling (tests/kernels)

    from msllm.kernels import library_path

    lib = ctypes.CDLL(library_path())
    rng = np.random.default_rng(0)
    print("seed 0", flush=True)
    shapes = LAYER * LAYERS
    keep = []   # the arrays and the shape buffers the prepared arguments point into

    def call_args(arrays):
        args, buffers = aot_args(arrays)
        keep.append((arrays, buffers))
        return args

    def product_set(kind: str, m: int):
        calls, total = [], 0
        xs = {n: rng.standard_normal((m, n)).astype(np.float32) for n in (576, 1536)}
        for out, n_in in shapes:
            y = np.zeros((m, out), np.float32)
            if kind == "int8":
                w = rng.integers(-127, 128, (out, n_in)).astype(np.int8)
                s = (rng.random((out, 1)) * 0.01).astype(np.float32)
                calls.append((lib.msllm_linear_int8, call_args([xs[n_in], w, s, np.array([float(n_in)], np.float32), y])))
            else:
                w = rng.standard_normal((out, n_in)).astype(np.float32)
                if kind == "bf16":
                    w = (w.view(np.uint32) >> 16).astype(np.uint16)
                calls.append((lib.msllm_linear, call_args([xs[n_in], w, y])))
            total += w.nbytes
        for f, a in calls[:1]:
            assert f(*a) == 0, f"{kind}: the kernel refused its inputs"
        return calls, total

    sets = {(k, m): product_set(k, m) for k in spec["kinds"] for m in spec["rows"]}
    res: dict = {}
    for rnd in range(spec["rounds"]):
        dists = spec["distances"] if rnd % 2 == 0 else spec["distances"][::-1]
        fars = spec["far"] if rnd % 2 == 0 else spec["far"][::-1]
        for (kind, m), (calls, total) in sets.items():
            for d, far in [(d, f) for d in dists for f in fars]:
                os.environ["MSLLM_GEMV_PREFETCH"] = str(d)
                os.environ["MSLLM_GEMV_PREFETCH_FAR"] = str(far)
                passes = []
                for _ in range(spec["passes"]):
                    t0 = time.perf_counter()
                    for f, a in calls:
                        f(*a)
                    passes.append(total / (time.perf_counter() - t0) / 1e9)
                key = f"{kind} m={m} prefetch={d} far={far}"
                res.setdefault(key, []).append(round(float(np.median(passes[1:])), 2))
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--isas", nargs="+", default=["native", "avx2"], choices=["native", "avx2"])
    p.add_argument("--distances", nargs="+", type=int, default=[0, 8192, 16384])
    p.add_argument("--far", nargs="+", type=int, default=[32768],
                   help="MSLLM_GEMV_PREFETCH_FAR distances")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--kinds", nargs="+", default=["f32", "bf16", "int8"], choices=["f32", "bf16", "int8"])
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        common.use_repo()
        print("GEMV_PREFETCH " + json.dumps(child(json.loads(a.child))), flush=True)
        return
    spec = {"rounds": a.rounds, "passes": a.passes, "distances": a.distances, "far": a.far, "rows": a.rows,
            "kinds": a.kinds}
    result = {"machine": common.machine(), "command": harness.command_line(), "spec": spec, "isas": {}}
    for isa in a.isas:
        rounds = common.run_isa_child(__file__, isa, spec, "GEMV_PREFETCH", unset="MSLLM_GEMV_PREFETCH")
        result["isas"][isa] = {k: {"gb_s_rounds": v, "gb_s_median": sorted(v)[len(v) // 2]} for k, v in rounds.items()}
        for k, v in result["isas"][isa].items():
            print(f"{isa:6s} {k:38s} {v['gb_s_median']:6.2f} GB/s  rounds {v['gb_s_rounds']}", flush=True)
    if a.out:
        harness.write_json(a.out, result)


if __name__ == "__main__":
    main()
