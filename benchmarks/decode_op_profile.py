"""Which operators a decode step runs and how long each computes, by MindSpore's own profiler (issue #32:
where the step's time outside msllm's kernels goes): the real SmolLM2-135M-Instruct or ``--tiny`` (the same
30-layer graph at hidden 64, :mod:`decode_profile`), a ``--prompt``-token prompt prefilled, then ``--steps``
batch-1 decode steps under ``mindspore.Profiler`` (its CPU operator table, ``cpu_op_type_info_0.csv``:
occurrences and compute time per operator type). The step's wall time minus the operators' compute time is
MindSpore's runtime around them (launch, scheduling, the graph's inputs and outputs) plus Python.

    .venv/bin/python benchmarks/decode_op_profile.py --tiny --dtype int8 --steps 100 \\
        --out benchmarks/results/decode_op_profile_tiny_amd_zen3.json

Prints one JSON line: median ms per step (under the profiler), and per operator type its calls and ms per step.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import decode_profile  # noqa: E402


def main(argv=None):
    p = decode_profile.model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), steps=100)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ["MSLLM_KERNEL_PROFILE"] = "0"
    common.use_repo()
    from mindspore import Profiler

    gen, tok, caches, pads, buffer, slot = decode_profile.prefilled(a, 1, a.steps)
    with tempfile.TemporaryDirectory(prefix="msprof.") as d:
        prof = Profiler(output_path=d, start_profile=True)
        step_ms, tok, caches, slot = decode_profile.timed_steps(gen, tok, slot, pads, buffer, caches, a.steps)
        prof.stop()
        prof.analyse()
        tables = glob.glob(os.path.join(d, "**", "cpu_op_type_info_0.csv"), recursive=True)
        if not tables:
            raise SystemExit(f"MindSpore's profiler wrote no cpu_op_type_info_0.csv under {d}")
        with open(tables[0]) as fh:
            rows = list(csv.DictReader(fh))
    ops = {r["op_type"]: {"calls_per_step": int(r["type_occurrences"]) / a.steps,
                          "ms_per_step": round(float(r["total_compute_time"]) / a.steps, 4)} for r in rows}
    mindspore_ops = sum(v["ms_per_step"] for k, v in ops.items() if k != "Custom")
    result = {"dtype": a.dtype, "tiny": a.tiny, "prompt": a.prompt, "steps": a.steps,
              "step_ms_median_under_profiler": round(step_ms, 3),
              "custom_ms_per_step": ops.get("Custom", {}).get("ms_per_step", 0.0),
              "mindspore_ops_ms_per_step": round(mindspore_ops, 4),
              "mindspore_ops_per_step": sum(v["calls_per_step"] for k, v in ops.items() if k != "Custom"),
              "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms_per_step"]))}
    print("DECODE_OP_PROFILE " + json.dumps(result))
    if a.out:
        import harness

        harness.write_json(a.out, dict(result, machine=common.machine(), command=harness.command_line()))


if __name__ == "__main__":
    main()
