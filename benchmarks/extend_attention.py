"""msllm's ``decode_attention`` kernel with T > 1 queries per row: a prefill piece attending over
the key/value cache (the serving engine's chunked prefill and prefix cache, issue #32), at
SmolLM2-135M's heads (9 query heads, 3 key/value heads of 64) and the chunked-prefill shapes of a
2,000-token prompt: T = 512 or 256 new tokens over a 2048-slot one-row cache, the piece ending at
slot ``--end`` (causal: query i sees slots ``--first`` .. end - T + i).

Each ``--checkouts`` entry is a msllm checkout with its kernels built (``python -m
msllm.kernels.build`` there); the checkouts are timed in alternation, one subprocess per
(round, checkout), best of ``--repeats`` calls each, so that two versions of the kernel are
compared inside one run on one machine:

    .venv/bin/python benchmarks/extend_attention.py --checkouts /work/old,/work/main --rounds 3 \\
        --out benchmarks/results/extend_attention_intel_xeon.json

Prints and stores ms per call (one layer) and x 30 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

CASES = [(512, 2048, 2048), (512, 2048, 1024), (256, 2048, 2048)]   # (T, S, end)


def time_cases(repeats: int, first: int) -> dict:
    """In this process (msllm imported from the current sys.path): ms per call for each case."""
    import time

    import mindspore as ms
    import numpy as np
    from mindspore import Tensor

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    from msllm.kernels import cpu_kernels

    kern = cpu_kernels()
    rng = np.random.default_rng(0)
    out = {}
    for t, s, end in CASES:
        h, kv, d = 9, 3, 64
        q = Tensor((rng.standard_normal((1, h, t, d)) * 0.125).astype(np.float32))
        kc = Tensor(rng.standard_normal((s, kv, d)).astype(np.float32))
        vc = Tensor(rng.standard_normal((s, kv, d)).astype(np.float32))
        mask = np.full((1, 1, t, s), -1e9, np.float32)
        for i in range(t):
            mask[0, 0, i, first:end - t + i + 1] = 0.0
        m = Tensor(mask)
        kern.decode_attention(q, kc, vc, m).asnumpy()          # first call: buffers, pool
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            kern.decode_attention(q, kc, vc, m).asnumpy()
            times.append(time.perf_counter() - t0)
        out[f"T{t}_S{s}_end{end}"] = 1e3 * min(times)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkouts", default=common.ROOT, help="comma-separated msllm checkouts (kernels built)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--first", type=int, default=30, help="first visible slot (left padding before it)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(HERE, "results", "extend_attention.json"))
    a = p.parse_args(argv)
    if a.child:
        sys.path.insert(0, a.child)
        print("RESULT " + json.dumps(time_cases(a.repeats, a.first)))
        return 0
    checkouts = [os.path.abspath(c) for c in a.checkouts.split(",")]
    runs = {c: [] for c in checkouts}
    for r in range(a.rounds):
        order = checkouts if r % 2 == 0 else checkouts[::-1]
        for c in order:
            env = dict(os.environ, PYTHONPATH=c)
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", c, "--repeats",
                                  str(a.repeats), "--first", str(a.first)], env=env, capture_output=True, text=True,
                                 check=True, cwd=c)
            line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
            runs[c].append(json.loads(line[7:]))
            print(f"round {r} {c}: {runs[c][-1]}", flush=True)
    import statistics

    summary = {c: {k: statistics.median(x[k] for x in runs[c]) for k in runs[c][0]} for c in checkouts}
    def commit(c):
        git = lambda *x: subprocess.run(["git", "-C", c, *x], capture_output=True, text=True).stdout.strip()  # noqa: E731
        return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if git("status", "--porcelain",
                                                                                      "--untracked-files=no") else "")

    commits = {c: commit(c) for c in checkouts}
    doc = {"benchmark": "extend_attention", "machine": common.machine(), "heads": [9, 3, 64],
           "cases": [list(x) for x in CASES], "first_visible_slot": a.first, "rounds": a.rounds,
           "repeats": a.repeats, "commits": commits, "ms_per_layer_median": summary,
           "ms_per_30_layers_median": {c: {k: 30 * v for k, v in s.items()} for c, s in summary.items()},
           "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    for c in checkouts:
        print(c, commits[c], {k: round(v, 2) for k, v in summary[c].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
