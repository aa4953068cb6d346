"""SmolLM2's decode step inside msllm's kernels alone, outside any framework (issue #32): the whole decoder stack
operator (``msllm_decode_stack``, csrc/decode_fused.cc: 30 layers, random weights of SmolLM2-135M's shapes)
and decode attention alone over 30 layers' caches (``msllm_decode_attention``, csrc/decode.cc), called through
ctypes on 2 threads, at ``--batch`` rows over caches of ``--slots`` slots of which the first ``--visible``
hold tokens. Each setting of ``MSLLM_DECODE_ATTENTION`` (``generic``: decode attention's generic loops;
empty: its fixed-width loops where the head dimension has them) is timed ``--calls`` times per round, the
settings in alternating order over ``--rounds`` rounds (the kernel reads the variable per call); per setting
the median over rounds of the median call. ``--variable`` names another variable the kernels read per call
to alternate instead (``MSLLM_GEMV_SPLIT``: how the weight-streaming products split their rows).

What it tells: the time a step's kernels need once MindSpore's per-call work is gone, and how close that
is to reading the bytes: weights (int8: 106 MB for the 30 layers) plus caches (25 MB at 544 slots, batch 1)
over the machine's read bandwidth. Back-to-back calls find part of those bytes still in the last-level
cache (an Intel Xeon guest reports 480 MiB of L3); ``--evict MB`` reads that many MiB of another buffer
before each timed call (untimed), as the rest of a decode step (the output head's 28-113 MB, MindSpore's
own work) does between two stack calls. Each ISA runs in a child process (``native``; ``avx2``: the library built
for haswell, ``common.isa_env``).

    .venv/bin/python benchmarks/decode_stack_kernel.py --rounds 3 --out benchmarks/results/decode_stack_kernel_<machine>.json
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

# SmolLM2-135M: width, query heads, key/value heads, head dimension, FFN width, layers
C, H, KV, D, F, LAYERS = 576, 9, 3, 64, 1536, 30


def child(spec: dict) -> dict:
    """Runs in the ISA's process: {"<kind> <what> attention=<setting>": [ms per round]} and the bytes."""
    import ctypes

    import numpy as np
    from kerneltest_helpers import aot_args

    from msllm.kernels import library_path

    lib = ctypes.CDLL(library_path())
    rng = np.random.default_rng(0)
    print("seed 0", flush=True)
    b, s, vis = spec["batch"], spec["slots"], spec["visible"]
    keep = []

    def prepared(arrays):
        args, shapes = aot_args(arrays)
        keep.append((arrays, shapes))
        return args

    def weight(kind, out, n):
        if kind == "int8":
            return [rng.integers(-127, 128, (out, n)).astype(np.int8), (rng.random((out, 1)) * 1e-3).astype(np.float32),
                    np.array([float(n)], np.float32)]
        w = (rng.standard_normal((out, n)) * 0.02).astype(np.float32)
        return [(w.view(np.uint32) >> 16).astype(np.uint16)] if kind == "bf16" else [w]

    pos = vis - 1                                        # the new token's slot and position
    ang = pos / 10000.0 ** (np.arange(0, D, 2) / D)
    cos = np.tile(np.cos(np.concatenate([ang, ang])), (b, 1)).reshape(b, 1, 1, D).astype(np.float32)
    sin = np.tile(np.sin(np.concatenate([ang, ang])), (b, 1)).reshape(b, 1, 1, D).astype(np.float32)
    mask = np.zeros((b, 1, 1, s), np.float32)
    mask[..., vis:] = -1e9
    index = (np.arange(b, dtype=np.int32) + pos * b).reshape(1, b)
    caches = [tuple(rng.standard_normal((s * b, KV, D)).astype(np.float32) for _ in range(2)) for _ in range(LAYERS)]
    q = rng.standard_normal((b, H, 1, D)).astype(np.float32)
    attention = [prepared([q, k, v, mask, np.zeros((b, H, 1, D), np.float32)]) for k, v in caches]
    calls, sizes = {}, {"cache_bytes": int(sum(k.nbytes + v.nbytes for k, v in caches) * vis // s)}
    for kind in spec["kinds"]:
        arrays = [rng.standard_normal((b, 1, C)).astype(np.float32), cos, sin, np.array([D ** -0.5], np.float32),
                  mask, index]
        wbytes = 0
        for k, v in caches:
            norm = [np.ones(C, np.float32), np.array([1e-5], np.float32)]
            front = norm + weight(kind, H * D, C) + weight(kind, KV * D, C) + weight(kind, KV * D, C)
            back = weight(kind, C, H * D) + [a.copy() for a in norm] + weight(kind, F, C) + weight(kind, F, C) + weight(kind, C, F)
            wbytes += sum(a.nbytes for a in front + back if a.ndim == 2 and a.shape[1] > 1)
            arrays += front + [k, v] + back
        calls[kind] = prepared(arrays + [np.zeros((b, 1, C), np.float32)])
        sizes[f"{kind}_weight_bytes"] = int(wbytes)
        assert lib.msllm_decode_stack(*calls[kind]) == 0, f"{kind}: the stack operator refused its inputs"

    evict = np.ones(spec["evict_mb"] << 17, np.int64) if spec["evict_mb"] else None

    def timed(fn) -> float:
        ts = []
        for _ in range(spec["calls"]):
            if evict is not None:
                evict.sum()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts[1:])) * 1e3

    res: dict = {}
    for rnd in range(spec["rounds"]):
        for setting in (spec["settings"] if rnd % 2 == 0 else spec["settings"][::-1]):
            os.environ[spec["variable"]] = setting
            name = (f"attention={setting or 'fixed'}" if spec["variable"] == "MSLLM_DECODE_ATTENTION"
                    else f"{spec['variable']}={setting or 'default'}")
            res.setdefault(f"attention x{LAYERS} {name}", []).append(
                round(timed(lambda: [lib.msllm_decode_attention(*a) for a in attention]), 3))
            for kind, args in calls.items():
                res.setdefault(f"{kind} stack {name}", []).append(round(timed(lambda: lib.msllm_decode_stack(*args)), 3))
    return {"ms": res, "bytes": sizes}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--slots", type=int, default=544)
    p.add_argument("--visible", type=int, default=530)
    p.add_argument("--isas", nargs="+", default=["native", "avx2"], choices=["native", "avx2"])
    p.add_argument("--kinds", nargs="+", default=["f32", "bf16", "int8"], choices=["f32", "bf16", "int8"])
    p.add_argument("--variable", default="MSLLM_DECODE_ATTENTION",
                   help="the environment variable --settings sets (the kernels read it per call)")
    p.add_argument("--settings", nargs="+", default=["generic", ""], help="values of --variable")
    p.add_argument("--evict", type=int, default=0, metavar="MB", help="read this many MiB before each timed call")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        common.use_repo()
        print("DECODE_STACK_KERNEL " + json.dumps(child(json.loads(a.child))), flush=True)
        return
    spec = {k: getattr(a, k) for k in ("rounds", "calls", "batch", "slots", "visible", "kinds", "settings", "variable")}
    spec["evict_mb"] = a.evict
    result = {"machine": common.machine(), "command": harness.command_line(), "spec": spec, "isas": {}}
    for isa in a.isas:
        got = common.run_isa_child(__file__, isa, spec, "DECODE_STACK_KERNEL", unset=a.variable)
        result["isas"][isa] = {"bytes": got["bytes"],
                               "ms": {k: {"rounds": v, "median": sorted(v)[len(v) // 2]} for k, v in got["ms"].items()}}
        for k, v in result["isas"][isa]["ms"].items():
            print(f"{isa:6s} {k:34s} {v['median']:7.3f} ms  rounds {v['rounds']}", flush=True)
    if a.out:
        harness.write_json(a.out, result)


if __name__ == "__main__":
    main()
