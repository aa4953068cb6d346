"""The decode step with its caches held by the graph against the same step taking them as a
``mutable`` tuple argument (msllm/generation/bound_caches.py), on SmolLM2-135M-Instruct (or
``--tiny``: the same 30-layer graph at hidden 64, where MindSpore's per-call work is most of the
step): one process, one prefilled cache set, blocks of ``--steps`` batch-``--batch`` decode steps
alternating between the two (``held``: the generator's kept set and the cell that holds it;
``tuple``: the generator's tuple-input step on the same caches), ``--rounds`` rounds; per block the
median ms per step. Both write the same slots of the same caches, so each block continues the
other's generation.

    .venv/bin/python benchmarks/decode_held_caches.py --dtype int8 --rounds 4 --out benchmarks/results/decode_held_caches_<dtype>_<machine>.json

Prints one JSON line per block and the summary (paired by round: held / tuple step time).
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
    p = decode_profile.model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), steps=50)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ["MSLLM_KERNEL_PROFILE"] = "0"
    common.use_repo()
    import numpy as np

    gen, tok, caches, pads, buffer, slot = decode_profile.prefilled(a, a.batch, a.rounds * 2 * (a.steps + 1))
    held_cell = gen.kept.cell_for
    if held_cell(caches) is None:
        sys.exit("decode_held_caches: the prefilled cache is not a kept set (MSLLM_BOUND_CACHE_MB too small?)")
    blocks = []
    for r in range(a.rounds):
        for mode in ("held", "tuple") if r % 2 == 0 else ("tuple", "held"):
            gen.kept.cell_for = held_cell if mode == "held" else (lambda c: None)
            logits, caches = gen.decode_step(tok, slot, pads, buffer, caches)   # not timed (the first tuple call compiles)
            tok, slot = logits.argmax(-1), slot + 1
            ms, tok, caches, slot = decode_profile.timed_steps(gen, tok, slot, pads, buffer, caches, a.steps)
            b = {"round": r, "mode": mode, "step_ms": round(ms, 3)}
            print(json.dumps(b), flush=True)
            blocks.append(b)
    per_round = ratios.paired(blocks, "held", "tuple", "step_ms", label="mode")     # held / tuple, round by round
    med = lambda m: round(float(np.median([b["step_ms"] for b in blocks if b["mode"] == m])), 3)  # noqa: E731
    summary = {"dtype": a.dtype, "tiny": a.tiny, "batch": a.batch, "prompt": a.prompt, "steps": a.steps,
               "rounds": a.rounds, "machine": common.machine(), "command": " ".join(sys.argv),
               "tuple_step_ms": med("tuple"), "held_step_ms": med("held"),
               "held_over_tuple": [round(x, 3) for x in per_round],
               "held_over_tuple_median": round(float(np.median(per_round)), 3), "blocks": blocks}
    print("DECODE_HELD_CACHES " + json.dumps({k: v for k, v in summary.items() if k not in ("blocks", "machine")}))
    if a.out:
        harness.write_json(a.out, summary)


if __name__ == "__main__":
    main()
