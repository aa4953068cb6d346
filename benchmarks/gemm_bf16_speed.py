"""The linear layer's three GEMMs (y = x W^T, dx = dy W, dW = dy^T x) through msllm's CPU kernels at
float32 and with ``compute_dtype: bfloat16`` (csrc/gemm_bf16.cc: bfloat16-rounded inputs, float32
sums; oneDNN's bf16 arithmetic where the CPU has it, and the emulation ``MSLLM_GEMM_BF16=emulate``
any CPU falls back to), on SmolLM2-135M's training shapes at ``--rows`` tokens (packed rows of 2048):
q/o, k/v, gate/up and down projections and the tied output head over the supervised positions.

Each shape is one compiled cell (GRAPH_MODE) running forward and both gradients; the three variants
alternate within every round (``--rounds``), so slow periods of the machine hit all of them. Rates
count 6 m n k FLOP per call (three GEMMs of 2 m n k). The per-step estimate weights each shape by
its count in one SmolLM2 step (30 layers; the head once).

    .venv/bin/python benchmarks/gemm_bf16_speed.py --rounds 3 --out benchmarks/results/gemm_bf16_speed_<machine>.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import common  # benchmarks/common.py: this script's directory is on sys.path

common.use_repo()

# name: (rows factor, in, out, calls per step); rows = --rows, the head's --head_rows
SHAPES = {"q/o proj": (576, 576, 60), "k/v proj": (576, 192, 60), "gate/up proj": (576, 1536, 60),
          "down proj": (1536, 576, 30), "output head": (576, 49152, 1)}
VARIANTS = ("float32", "bf16", "bf16-emulated")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per shape, variant and round (median)")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--head_rows", type=int, default=1285, help="supervised positions of a packed row")
    p.add_argument("--out", default=os.path.join(common.HERE, "results", "gemm_bf16_speed.json"))
    a = p.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from msllm.kernels import build, cpu_kernels, gemm_bf16_native

    build.build(verbose=False)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    native = gemm_bf16_native()
    ops_of = {"float32": cpu_kernels("float32"), "bf16": cpu_kernels("bfloat16")}

    class Step(nn.Cell):
        def __init__(self, linear):
            super().__init__()
            self.grad = ops.GradOperation(get_all=True, sens_param=True)(linear)

        def construct(self, x, w, dy):
            return self.grad(x, w, dy)

    class Lin(nn.Cell):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def construct(self, x, w):
            return self.op(x, w)

    rng = np.random.default_rng(0)
    print("seed 0; bf16 arithmetic on this CPU:", native)
    cases = {}
    for name, (k, n, calls) in SHAPES.items():
        m = a.head_rows if name == "output head" else a.rows
        x, w, dy = (Tensor(rng.standard_normal(s).astype(np.float32)) for s in ((m, k), (n, k), (m, n)))
        cells = {v: Step(Lin(ops_of["float32" if v == "float32" else "bf16"].linear)) for v in ("float32", "bf16")}
        cases[name] = (m, k, n, calls, x, w, dy, cells)
    runs = []
    for rnd in range(a.rounds):
        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
        for name, (m, k, n, calls, x, w, dy, cells) in cases.items():
            for v in order:
                if v == "bf16-emulated":
                    os.environ["MSLLM_GEMM_BF16"] = "emulate"
                else:
                    os.environ.pop("MSLLM_GEMM_BF16", None)
                cell = cells["float32" if v == "float32" else "bf16"]
                cell(x, w, dy)[0].asnumpy()            # compile / warm
                ts = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    cell(x, w, dy)[0].asnumpy()
                    ts.append(time.perf_counter() - t0)
                s = common.median(ts)
                runs.append({"round": rnd, "shape": name, "variant": v, "m": m, "k": k, "n": n, "seconds": s,
                             "gflops": 6 * m * k * n / s / 1e9})
                print(f"round {rnd + 1} {name:<12} {v:<14} {s * 1e3:8.2f} ms {6 * m * k * n / s / 1e9:7.1f} GFLOP/s",
                      flush=True)
    os.environ.pop("MSLLM_GEMM_BF16", None)
    summary = {}
    for v in VARIANTS:
        per_round = []
        for rnd in range(a.rounds):
            per_round.append(sum(r["seconds"] * cases[r["shape"]][3] for r in runs
                                 if r["round"] == rnd and r["variant"] == v))
        summary[v] = {"step_gemm_seconds_median": common.median(per_round), "per_round": per_round}
    for v in ("bf16", "bf16-emulated"):
        ratios = [summary["float32"]["per_round"][i] / summary[v]["per_round"][i] for i in range(a.rounds)]
        summary[v]["float32_over_this"] = {"median": common.median(ratios), "min": min(ratios), "max": max(ratios)}
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump({"machine": common.machine(), "bf16_native": native, "args": vars(a), "runs": runs,
                   "summary": summary}, fh, indent=1)
    print("written", a.out)


if __name__ == "__main__":
    main()
