"""Batch-1 decode steps in a loop for an outside profiler (issue #32: where the step's time outside msllm's kernels
goes): the real SmolLM2-135M-Instruct (or ``--tiny``, the same 30-layer graph at hidden 64; :mod:`decode_profile`)
prefilled with a ``--prompt``-token prompt (seed 0), then decode steps over 32 cache slots again and again for
``--seconds``. It writes its pid to ``--ready`` once warm, so a profiler attaches to the steady state only:

    .venv/bin/python benchmarks/decode_perf_loop.py --dtype float32 --seconds 25 --ready /tmp/ready &
    while [ ! -s /tmp/ready ]; do sleep 1; done; sleep 2
    perf record -e cpu-clock -F 4000 -p $(cat /tmp/ready) -o /tmp/perf.data -- sleep 15
    perf script -i /tmp/perf.data -F tid,ip,dso    # samples per shared object of the busiest thread

Prints the steps run and the mean ms per step (under the profiler). ``MSLLM_DIRECT_DECODE=0`` profiles the step
through MindSpore's compiled graph (msllm/generation/direct_step.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import decode_profile  # noqa: E402


def main(argv=None):
    p = decode_profile.model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), steps=32)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--ready", default=None, help="write this process's pid here once warm")
    a = p.parse_args(argv)
    os.environ["MSLLM_KERNEL_PROFILE"] = "0"
    common.use_repo()
    gen, tok, caches, pads, buffer, slot = decode_profile.prefilled(a, 1, 64)
    if a.ready:
        with open(a.ready + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(a.ready + ".tmp", a.ready)
    n, t0 = 0, time.perf_counter()
    end = time.time() + a.seconds
    while time.time() < end:
        for s in range(slot, slot + 32):     # the same 32 slots again: the cache stays as long
            logits, caches = gen.decode_step(tok, s, pads, buffer, caches)
            tok = logits.argmax(-1)
            n += 1
    print(f"steps {n} ms/step {(time.perf_counter() - t0) * 1e3 / n:.3f}", flush=True)


if __name__ == "__main__":
    main()
