"""What MindSpore 2.10 costs per compiled-graph call and per operator on CPU (issue #32: could the decode step's
small operators, moved into msllm's kernel, save much?): GRAPH_MODE cells that chain 1, 11 and 26 links of two
operators each (``Mul``, ``Add`` on a (1, 64) float32 tensor), ``--calls`` calls per block, the three cells in
alternating order over ``--rounds`` rounds; per cell the median ms per call; per operator the slope between 26
links and 1 (50 operators more). Then per parameter input: cells holding 10, 100 and 500 (1, 64) Parameters that
one ``AddN`` sums (the decode step's graph has about 550 parameter inputs, most of them into msllm's one
decoder-stack operator), the same alternation; the slope between 500 and 10.

    .venv/bin/python benchmarks/ms_launch_cost.py --rounds 5 --out benchmarks/results/ms_launch_cost_amd_zen3.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

LINKS = (1, 11, 26)
INPUTS = (10, 100, 500)


def alternate(cells: dict, x, rounds: int, calls: int) -> dict:
    """{key: [ms per call per round]}: each cell called ``calls`` times per round, the order flipped every round."""
    keys = list(cells)
    out = {k: [] for k in keys}
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            t = time.perf_counter()
            for _ in range(calls):
                y = cells[k](*x)
            y.asnumpy()
            out[k].append((time.perf_counter() - t) / calls * 1e3)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

    class Chain(nn.Cell):
        def __init__(self, n):
            super().__init__()
            self.n = n

        def construct(self, x, y):
            for _ in range(self.n):
                x = ops.mul(x, y) + 1.0
            return x

    class Many(nn.Cell):
        def __init__(self, k):
            super().__init__()
            self.ps = ParameterTuple([Parameter(Tensor(np.full((1, 64), 1e-3, np.float32)), name=f"p{k}_{i}")
                                      for i in range(k)])

        def construct(self, x):
            return x + ops.addn(self.ps)

    x, y = Tensor(np.ones((1, 64), np.float32)), Tensor(np.full((1, 64), 0.5, np.float32))
    chains = {n: Chain(n) for n in LINKS}
    many = {k: Many(k) for k in INPUTS}
    alternate(chains, (x, y), 1, 20)   # compile and warm up
    alternate(many, (x,), 1, 20)
    per_call = alternate(chains, (x, y), a.rounds, a.calls)
    per_input = alternate(many, (x,), a.rounds, a.calls)
    med = {n: float(np.median(v)) for n, v in per_call.items()}
    med_in = {k: float(np.median(v)) for k, v in per_input.items()}
    result = {"ms_per_call_median": {str(n): round(v, 4) for n, v in med.items()},
              "ms_per_call_rounds": {str(n): [round(t, 4) for t in v] for n, v in per_call.items()},
              "us_per_operator": round((med[LINKS[-1]] - med[LINKS[0]]) / (2 * (LINKS[-1] - LINKS[0])) * 1e3, 2),
              "inputs_ms_per_call_median": {str(k): round(v, 4) for k, v in med_in.items()},
              "inputs_ms_per_call_rounds": {str(k): [round(t, 4) for t in v] for k, v in per_input.items()},
              "us_per_parameter_input": round((med_in[INPUTS[-1]] - med_in[INPUTS[0]])
                                              / (INPUTS[-1] - INPUTS[0]) * 1e3, 3)}
    print("MS_LAUNCH_COST " + json.dumps(result))
    if a.out:
        import harness

        harness.write_json(a.out, dict(result, machine=common.machine(), command=harness.command_line()))


if __name__ == "__main__":
    main()
