"""What skipping ``Cell.__call__``'s argument checks saves a decode step (msllm/generation/replay.py: a
replayed cell's ``__call__`` goes straight to the recorded graph): SmolLM2-135M-Instruct (or ``--tiny``,
the same 30-layer graph at hidden 64, where the call is most of the step) prefilled with a
``--prompt``-token prompt, then batch-``--batch`` decode steps through the generator's held-cache step,
in blocks of ``--steps`` alternating between MindSpore's ``Cell.__call__`` in front of the replay
(``checks``: what msllm did before) and the replay's own ``__call__`` (``skip``), in one process,
``--rounds`` rounds; per block the median ms per step.

    .venv/bin/python benchmarks/replay_call_checks.py --dtype int8 --rounds 6 --out benchmarks/results/replay_call_checks_<dtype>_<machine>.json

Prints one JSON line per block and the summary (paired by round: skip / checks step time, and the
difference in microseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import decode_profile  # noqa: E402
import harness  # noqa: E402
import ratios  # noqa: E402


def main(argv=None):
    p = decode_profile.model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), steps=60)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ["MSLLM_KERNEL_PROFILE"] = "0"
    common.use_repo()
    import numpy as np
    from mindspore import nn

    gen, tok, caches, pads, buffer, slot = decode_profile.prefilled(a, a.batch, a.rounds * 2 * a.steps)
    bound = gen.kept.cell_for(caches)
    if bound is None:
        sys.exit("replay_call_checks: the prefilled cache is not a kept set (MSLLM_BOUND_CACHE_MB too small?)")
    cls = type(bound)
    own_call = cls.__dict__.get("__call__")
    if own_call is None:
        sys.exit("replay_call_checks: this checkout's replayed cells have no __call__ of their own")
    blocks = []
    try:
        for r in range(a.rounds):
            for mode in ("checks", "skip") if r % 2 == 0 else ("skip", "checks"):
                cls.__call__ = nn.Cell.__call__ if mode == "checks" else own_call
                ms, tok, caches, slot = decode_profile.timed_steps(gen, tok, slot, pads, buffer, caches, a.steps)
                b = {"round": r, "mode": mode, "step_ms": round(ms, 4)}
                print(json.dumps(b), flush=True)
                blocks.append(b)
    finally:
        cls.__call__ = own_call
    per_round = ratios.paired(blocks, "skip", "checks", "step_ms", label="mode")
    by = {m: [b["step_ms"] for b in blocks if b["mode"] == m] for m in ("checks", "skip")}
    step = {(b["round"], b["mode"]): b["step_ms"] for b in blocks}
    saved_us = [round((step[r, "checks"] - step[r, "skip"]) * 1e3, 1) for r in range(a.rounds)]
    summary = {"dtype": a.dtype, "tiny": a.tiny, "batch": a.batch, "prompt": a.prompt, "steps": a.steps,
               "rounds": a.rounds, "machine": common.machine(), "command": " ".join(sys.argv),
               "checks_step_ms": round(float(np.median(by["checks"])), 4),
               "skip_step_ms": round(float(np.median(by["skip"])), 4),
               "skip_over_checks": [round(x, 4) for x in per_round],
               "skip_over_checks_median": round(float(np.median(per_round)), 4),
               "saved_us_per_round": saved_us, "saved_us_median": round(float(np.median(saved_us)), 1),
               "blocks": blocks}
    print("REPLAY_CALL_CHECKS " + json.dumps({k: v for k, v in summary.items() if k not in ("blocks", "machine")}))
    if a.out:
        harness.write_json(a.out, summary)


if __name__ == "__main__":
    main()
