"""Where a 512-token prefill of the real SmolLM2-135M-Instruct spends its time, per msllm kernel
(``MSLLM_KERNEL_PROFILE=1``: wall time inside each kernel, summed over the prefill), at the weights and
compute dtype of ``--mode``: ``f32`` (float32 weights), ``bf16`` (bfloat16 weights, float32 arithmetic) or
``bf16c`` (bfloat16 weights with ``compute_dtype: bfloat16``: the GEMMs round the activations to bfloat16,
llama.cpp's bf16 arithmetic). One process per mode, the modes alternating over ``--rounds``; per round the
median of ``--reps`` prefills after an untimed one (the first compiles). Found, on an AMD EPYC Zen 5,
that the stacked decoder layers had dropped bf16 compute (BENCHMARKS.md, "AMD EPYC Zen 5").

    .venv/bin/python benchmarks/prefill_kernels.py --rounds 3 --out benchmarks/results/prefill_kernels_<machine>.json

Prints one JSON line per prefill and the summary: per mode the median over rounds of the prefill's wall ms and
of each kernel's ms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402

MODES = {"f32": [], "bf16": ["--model.model_config.param_init_type=bfloat16"],
         "bf16c": ["--model.model_config.param_init_type=bfloat16", "--model.model_config.compute_dtype=bfloat16"]}


def child(mode: str, prompt: int, reps: int) -> list:
    """In a process of its own: ``reps`` timed prefills of a ``prompt``-token prompt (seed 0) at ``mode``."""
    os.environ["MSLLM_KERNEL_PROFILE"] = "1"
    common.use_repo()
    import mindspore as ms
    import numpy as np

    from msllm.cluster.context import setup_runtime
    from msllm.config import load_config
    from msllm.convert.real_model import ensure_smollm2
    from msllm.generation.decode import generator_for
    from msllm.generation.loading import load_for_inference
    from msllm.generation.passes import round_up
    from msllm.kernels import kernel_stats

    cfg = load_config(os.path.join(common.ROOT, "configs", "smollm2", "run_smollm2_135m.yaml"),
                      ["--parallel_config.data_parallel=1"] + MODES[mode])
    setup_runtime(cfg, inference=True)
    ms.set_context(runtime_num_threads=2)
    net, mc, _ = load_for_inference(cfg, ensure_smollm2())
    gen = generator_for(net, mc)
    print("seed 0", flush=True)
    ids = np.random.default_rng(0).integers(1, min(mc.vocab_size, 30000), prompt).tolist()
    runs = []
    for i in range(reps + 1):
        kernel_stats(reset=True)
        t0 = time.perf_counter()
        _, caches, _ = gen.prefill([ids], prompt, round_up(prompt + 64), 0)
        wall = time.perf_counter() - t0
        gen.release_cache(caches)
        stats = kernel_stats()
        if i:
            runs.append({"prefill_ms": round(wall * 1e3, 2),
                         "kernels_ms": {k: round(v[1] * 1e3, 2) for k, v in stats.items() if v[0]}})
    return runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print("PREFILL_RUNS " + json.dumps(child(a.child, a.prompt, a.reps)), flush=True)
        return
    import numpy as np

    t0 = time.time()
    rows = []
    for r in range(a.rounds):
        for mode in a.modes if r % 2 == 0 else a.modes[::-1]:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--prompt", str(a.prompt),
                   "--reps", str(a.reps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs = json.loads(next(line for line in out.splitlines() if line.startswith("PREFILL_RUNS "))[13:])
            row = {"round": r, "mode": mode, "prefill_ms": float(np.median([x["prefill_ms"] for x in runs])),
                   "kernels_ms": {k: float(np.median([x["kernels_ms"].get(k, 0.0) for x in runs]))
                                  for k in runs[0]["kernels_ms"]}, "runs": runs}
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
            rows.append(row)
    summary = {}
    for mode in a.modes:
        mine = [x for x in rows if x["mode"] == mode]
        kernels = sorted({k for x in mine for k in x["kernels_ms"]})
        summary[mode] = {"prefill_ms": round(float(np.median([x["prefill_ms"] for x in mine])), 1),
                         "kernels_ms": {k: round(float(np.median([x["kernels_ms"].get(k, 0.0) for x in mine])), 1)
                                        for k in kernels}}
    print("PREFILL_KERNELS " + json.dumps(summary))
    if a.out:
        commit = subprocess.run(["git", "-C", common.ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        harness.write_json(a.out, {"machine": common.machine(), "command": " ".join(sys.argv), "commit": commit or None,
                                   "settings": vars(a), "summary": summary, "rows": rows,
                                   "total_seconds": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
