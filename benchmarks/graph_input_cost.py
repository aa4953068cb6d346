"""What MindSpore 2.10 spends per call of a compiled GRAPH_MODE cell on its inputs, on the CPU
(issue #32: where SmolLM2's decode step spends ~4 ms outside msllm's kernels).

The cell's one operator (``graph_input_noop.c``, compiled into ``benchmarks/.cache``) does nothing;
its inputs are like the decode step's: ``--weights`` Parameters of (576, 576) float32 (SmolLM2's
stack operator takes ~450) and ``--caches`` key/value caches of (S, 3, 64) float32 (60 for 30 layers),
either passed each call as an ``ms.mutable`` tuple argument of Tensors (``mutable``) or of Parameters
(``mutable_params``: what msllm's generator passed before its decode step held the caches), or held by
the cell as Parameters (``params``: msllm/generation/bound_caches.py). Each call goes the way
msllm's generator replays a compiled step (``msllm/generation/replay.py``: ``get_args_for_run`` then
``_exec_pip``, no per-call compile). Each configuration runs in its own process, the configurations
in alternating order over ``--rounds`` rounds; per configuration the median over rounds of the
median microseconds per call.

    .venv/bin/python benchmarks/graph_input_cost.py --rounds 3 --out benchmarks/results/graph_input_cost_<machine>.json
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

# (weights, caches, how the caches arrive, cache slots S)
CONFIGS = [(10, 2, "mutable", 544), (450, 2, "mutable", 544), (10, 60, "mutable", 544), (450, 60, "mutable", 544),
           (450, 60, "mutable", 2048), (10, 60, "params", 544), (200, 60, "params", 544), (450, 60, "params", 544),
           (10, 60, "mutable_params", 544), (450, 60, "mutable_params", 544)]

CHILD = r"""
import sys, time
import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, mutable, nn, ops
from mindspore.graph.api import _cell_graph_executor

lib, n_w, n_c, how, slots, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
op = ops.Custom(lib + ":noop", lambda x, *r: x, lambda x, *r: x, "aot")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.ws = ParameterTuple([Parameter(Tensor(np.ones((576, 576), np.float32)), name=f"w{i}") for i in range(n_w)])
        if how == "params":
            self.cs = ParameterTuple([Parameter(Tensor(np.ones((slots, 3, 64), np.float32)), name=f"c{i}")
                                      for i in range(n_c)])

    def construct(self, x, caches):
        if how == "params":
            return op(x, *self.ws, *self.cs)
        return op(x, *self.ws, *caches)


net = Net()
x = Tensor(np.ones(64, np.float32))
if how == "mutable_params":   # what msllm's generator passed: cache Parameters in the mutable tuple
    caches = mutable(tuple(Parameter(Tensor(np.ones((slots, 3, 64), np.float32)), name=f"c{i}", requires_grad=False)
                           for i in range(n_c)))
else:
    caches = mutable(tuple(Tensor(np.ones((slots, 3, 64), np.float32)) for _ in range(n_c if how == "mutable" else 1)))
net(x, caches)   # compiles; names the phase
phase, flags = net.current_phase, list(net._has_mutable_args_list or [])
ex = _cell_graph_executor._graph_executor
ts = []
for _ in range(calls):
    t = time.perf_counter()
    run_args = ex.get_args_for_run(net, (x, caches), {}, flags, [], False, False)
    _cell_graph_executor._exec_pip(net, *run_args, phase=phase)
    ts.append(time.perf_counter() - t)
print("US", float(np.median(ts[calls // 10:])) * 1e6)
"""


def build() -> str:
    """graph_input_noop.c -> benchmarks/.cache/libgraph_input_noop.so (rebuilt when the source is newer)."""
    return common.build_cached("graph_input_noop.c", "libgraph_input_noop.so", ["gcc", "-O2", "-shared", "-fPIC"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    lib = build()
    child = os.path.join(HERE, ".cache", "graph_input_cost_child.py")   # MindSpore parses construct's source file
    with open(child + ".tmp", "w") as fh:
        fh.write(CHILD)
    os.replace(child + ".tmp", child)
    runs: dict = {"/".join(map(str, c)): [] for c in CONFIGS}
    for r in range(a.rounds):
        for c in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
            res = subprocess.run([sys.executable, child, lib, *map(str, c), str(a.calls)], capture_output=True,
                                 text=True, check=True)
            us = float([ln for ln in res.stdout.splitlines() if ln.startswith("US ")][-1].split()[1])
            runs["/".join(map(str, c))].append(round(us, 1))
            print(f"round {r} weights/caches/how/slots {'/'.join(map(str, c))}: {us:.0f} us per call", flush=True)
    summary = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in summary.items():
        print(f"{k}: {v:.0f} us")
    if a.out:
        import harness

        harness.write_json(a.out, {"benchmark": "graph_input_cost", "machine": common.machine(),
                                   "command": " ".join(sys.argv), "configs": "weights/caches/how/slots",
                                   "us_per_call_median": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
