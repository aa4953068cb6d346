"""Decode (batch 1, or ``--batch``) with two settings of a kernel switch that the kernels read per call, alternated in
blocks of ``--steps`` decode steps in one process, ``--rounds`` rounds (the order flips every round):
the real SmolLM2-135M-Instruct at ``--dtype`` weights prefilled with a ``--prompt``-token prompt, then
steps through the generator. One process, one compiled graph, the same caches: what differs between
blocks is only a kernel's inner loop, so this pairs more tightly than two processes of
``ab_decode_checkouts.py`` on a drifting machine. Switches (both settings give the same bits):

``--var`` may name several variables, comma-separated, and each of ``--values`` then gives one value per name
(an empty one: unset, the kernels' default). The result's ``env`` records every other ``MSLLM_`` variable set.

* ``--var MSLLM_GEMV_PREFETCH,MSLLM_GEMV_PREFETCH_FAR --values 8192,32768 ,``: both software prefetches at the
  distances every loop had before 2026-12-07 against the defaults (none for a loop streaming 8 weight rows at
  once: ``stream_prefetch`` in ``msllm/kernels/csrc/stream.h``);
* ``--var MSLLM_GEMV_ROWS --values 2 8`` (default): the weight-streaming products reading 2 or 8 weight
  rows at once (``stream_rows_at_once`` in ``msllm/kernels/csrc/stream.h``; tests/kernels/test_kernels_gemv_rows.py);
* ``--var MSLLM_GEMV_MAX_ROWS --values 4 8 --batch 8``: float32 products of 5-8 rows streaming W or on
  oneDNN's sgemm (``gemv_max_rows`` in ``msllm/kernels/csrc/linear.cc``; different summation orders). Run it
  with ``common.AVX2_ENV`` and ``MSLLM_KERNELS_DIR=benchmarks/.cache/kernels-haswell`` set for the AVX2 path;
* ``--var MSLLM_DECODE_STACK --values 0 1 --at build``: the decode step's decoder layers as two fused
  operators each or as one operator for the whole stack (``LlamaModel.decode_layers``); read when the model
  is built, so ``--at build`` builds two models (same weights, each its own caches and compiled graph)
  and alternates between them;
* ``--var MSLLM_DIRECT_DECODE --values 0 1 --at build``: every decode step through MindSpore's compiled graph, or
  msllm's kernels called on the model's buffers (``msllm/generation/direct_step.py``; read when the generator is
  made, so ``--at build``);
* ``--var MSLLM_STACK_WEIGHTS --values 0 1 --at build``: the decoder stack operator's weights one layer after
  another or each kind stacked over the layers (``msllm/models/llama/stacked.py``; read when the model is loaded);
* ``--var MSLLM_DECODE_ATTENTION --values generic ''``: decode attention's generic loops or its fixed-width ones
  (each head's query and output in registers; ``head_kernels`` in ``msllm/kernels/csrc/decode.cc``; the same bits);
* ``--var MSLLM_BF16_PAIRS --values 0 1``: a trial, not kept (2026-11-28, AMD EPYC Zen 4,
  ``decode_bf16_pairs_ab_bfloat16_amd_zen4.json``: 0.99x the step): bfloat16 weights widened 32 per load in lane
  (a shift for the even ones, a mask for the odd ones, x split into even and odd inputs) instead of 16 per
  zero-extend; the kernels no longer read that variable.
* ``--var MSLLM_DECODE_VALUES --values axpy group``: a trial, not kept (2026-11-28, AMD EPYC Zen 4,
  ``decode_values_ab_{float32,int8}_amd_zen4.json``: 1.00x / 1.08x the step): decode attention's value
  sums per slot and head through memory (axpy, ``csrc/decode.cc``) or each kv head's query group held
  in registers; the kernel no longer reads that variable.
* ``--var MSLLM_DECODE_WARM_BYTES --values 0 33554432`` (and ``67108864``): a trial, not kept (2026-11-29, Intel
  Xeon, ``decode_warm_next_ab_int8_{32,64}mb_intel_xeon.json``: 1.01x / 1.06x the int8 step): after the decoder
  stack's operator, a thread of its own prefetched (``prefetcht2``) the first 32 / 64 MB of the next step's
  weights once no kernel had run for 100 us, i.e. while MindSpore ran the rest of the step; the kernels no
  longer read that variable.

    .venv/bin/python benchmarks/decode_gemv_rows_ab.py --dtype float32 --rounds 6 --out benchmarks/results/decode_gemv_rows_ab_<machine>.json

Prints one JSON line per block and the summary (per round B's over A's median step). Result files from
before ``--var`` (``decode_gemv_rows_ab_*_amd_zen4.json``) name the settings rows2 / rows8.
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
    p = decode_profile.model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), steps=40)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=1, help="prompts decoded at once")
    p.add_argument("--var", default="MSLLM_GEMV_ROWS")
    p.add_argument("--values", nargs=2, default=["2", "8"], metavar=("A", "B"))
    p.add_argument("--at", choices=["call", "build"], default="call",
                   help="when the variable is read: at each kernel call (one model) or when the model is "
                        "built (two models)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ["MSLLM_KERNEL_PROFILE"] = "0"
    common.use_repo()
    import numpy as np

    names = a.var.split(",")
    for value in a.values:
        if len(value.split(",")) != len(names):
            p.error(f"--values {value!r}: expected {len(names)} comma-separated values, one per name of --var {a.var}")
    held = {k: v for k, v in os.environ.items() if k.startswith("MSLLM_") and k not in names}   # the fixed rest

    def setting(value: str) -> None:
        for name, v in zip(names, value.split(",")):
            os.environ[name] = v

    runs = {}   # setting -> [generator, next tokens, caches, pads, buffer, next slot]
    for value in a.values if a.at == "build" else a.values[:1]:
        setting(value)
        runs[value] = list(decode_profile.prefilled(a, a.batch, a.rounds * a.steps * (1 if a.at == "build" else 2)))
    if a.at == "call":
        runs[a.values[1]] = runs[a.values[0]]
    blocks = []
    for r in range(a.rounds):
        for value in a.values if r % 2 == 0 else a.values[::-1]:
            setting(value)
            run = runs[value]
            gen, tok, caches, pads, buffer, slot = run
            ms, tok, caches, slot = decode_profile.timed_steps(gen, tok, slot, pads, buffer, caches, a.steps)
            run[1:] = [tok, caches, pads, buffer, slot]
            b = {"round": r, a.var: value, "step_ms": round(ms, 3)}
            print(json.dumps(b), flush=True)
            blocks.append(b)
    per_round = ratios.paired(blocks, a.values[1], a.values[0], "step_ms", label=a.var)   # b / a, round by round
    med = lambda v: round(float(np.median([b["step_ms"] for b in blocks if b[a.var] == v])), 3)  # noqa: E731
    summary = {"dtype": a.dtype, "batch": a.batch,
               "env": dict(held, **{k: os.environ[k] for k in common.AVX2_ENV if k in os.environ}),
               "prompt": a.prompt, "steps": a.steps, "rounds": a.rounds,
               "machine": common.machine(), "command": " ".join(sys.argv), "var": a.var, "values": a.values, "at": a.at,
               "a_step_ms": med(a.values[0]), "b_step_ms": med(a.values[1]), "b_over_a": [round(x, 3) for x in per_round],
               "b_over_a_median": round(float(np.median(per_round)), 3), "blocks": blocks}
    print("DECODE_KERNEL_AB " + json.dumps({k: v for k, v in summary.items() if k not in ("blocks", "machine")}))
    if a.out:
        harness.write_json(a.out, summary)


if __name__ == "__main__":
    main()
