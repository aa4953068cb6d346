"""What MindSpore's per-call Python work costs a decode step, and what calling the compiled graph
directly (:mod:`msllm.generation.replay`) saves: the real SmolLM2-135M-Instruct (or ``--tiny``,
the same 30-layer graph at hidden 64, where the call is most of the step) prefilled with a
``--prompt``-token prompt, then batch-``--batch`` decode steps through the generator, in blocks of
``--steps`` alternating between MindSpore's own call path (``ms``) and the replay (``replay``)
in one process, ``--rounds`` rounds; per block the median ms per step and the ms of it inside
MindSpore's graph run (``_exec_pip``: the graph's operators), the rest being Python. The switch applies
to the cell the step calls: the one holding the kept cache set (msllm/generation/bound_caches.py), else
the tuple-input step (until 2026-11-29 it applied to the latter only, which a kept set's step does not call).

    .venv/bin/python benchmarks/decode_call_overhead.py --rounds 4 --out benchmarks/results/decode_call_overhead_<machine>.json

Prints one JSON line per block and the summary (paired by round: replay / ms step time).
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
import decode_profile  # noqa: E402
import harness  # noqa: E402
import ratios  # noqa: E402


def main(argv=None):
    p = decode_profile.model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), steps=50)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ["MSLLM_KERNEL_PROFILE"] = "0"
    common.use_repo()
    import numpy as np
    from mindspore.graph import api

    gen, tok, caches, pads, buffer, slot = decode_profile.prefilled(a, a.batch, a.rounds * 2 * a.steps)
    inside = [0.0]
    run_graph = api._CellGraphExecutor._exec_pip

    def timed(self, obj, *args, phase=""):
        t = time.perf_counter()
        try:
            return run_graph(self, obj, *args, phase=phase)
        finally:
            inside[0] += time.perf_counter() - t

    api._CellGraphExecutor._exec_pip = timed
    blocks = []
    for r in range(a.rounds):
        for mode in ("ms", "replay") if r % 2 == 0 else ("replay", "ms"):
            # the cell decode_step calls: the one holding the kept cache set, else the tuple-input step
            step_cell = gen.kept.cell_for(caches)
            step_cell = gen.step if step_cell is None else step_cell
            step_cell.__dict__["_replay_phases"] = {} if mode == "replay" else None
            if mode == "replay":   # its first call goes through MindSpore and records the phase
                logits, caches = gen.decode_step(tok, slot, pads, buffer, caches)
                slot += 1
            walls, ins = [], []
            for _ in range(a.steps):
                inside[0] = 0.0
                t0 = time.perf_counter()
                logits, caches = gen.decode_step(tok, slot, pads, buffer, caches)
                tok = logits.argmax(-1)
                walls.append(time.perf_counter() - t0)
                ins.append(inside[0])
                slot += 1
            b = {"round": r, "mode": mode, "step_ms": round(float(np.median(walls)) * 1e3, 3),
                 "graph_ms": round(float(np.median(ins)) * 1e3, 3)}
            b["python_ms"] = round(b["step_ms"] - b["graph_ms"], 3)
            print(json.dumps(b), flush=True)
            blocks.append(b)
    per_round = ratios.paired(blocks, "replay", "ms", "step_ms", label="mode")     # replay / ms, round by round
    med = lambda m, k: round(float(np.median([b[k] for b in blocks if b["mode"] == m])), 3)  # noqa: E731
    summary = {"dtype": a.dtype, "tiny": a.tiny, "batch": a.batch, "prompt": a.prompt, "steps": a.steps,
               "rounds": a.rounds, "machine": common.machine(), "command": " ".join(sys.argv),
               "ms": {k: med("ms", k) for k in ("step_ms", "graph_ms", "python_ms")},
               "replay": {k: med("replay", k) for k in ("step_ms", "graph_ms", "python_ms")},
               "replay_over_ms_step": [round(x, 3) for x in per_round],
               "replay_over_ms_median": round(float(np.median(per_round)), 3), "blocks": blocks}
    print("DECODE_CALL_OVERHEAD " + json.dumps({k: v for k, v in summary.items() if k not in ("blocks", "machine")}))
    if a.out:
        harness.write_json(a.out, summary)


if __name__ == "__main__":
    main()
