"""In-process A/B of the fused decode step (``DecoderLayer.decode_fused``, msllm/kernels/csrc/decode_fused.cc)
against the operator-by-operator path on the real SmolLM2-135M-Instruct: two copies of the model
with the same weights (``--dtype`` float32 / bfloat16 / int8), one with the fused operators switched
off, each prefilled with the same ``--prompt``-token prompts (benchmarks/decode_speed.py's) at each
``--batches`` size, then blocks of ``--steps`` greedy decode steps alternating A (unfused), B (fused)
for ``--rounds`` rounds (B first in odd rounds), each step timed. Both continue their own greedy
tokens, which must be the same.

    .venv/bin/python benchmarks/decode_ab_fused.py --dtype float32 --batches 1 8 --rounds 3

Prints one ``DECODE_AB {json}`` line: per batch, the median ms per step of A and B, the ratio
B / A of the medians and per round, and whether the tokens are identical.
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    common.use_repo()
    import numpy as np

    import mindspore as ms

    from msllm.cluster.context import setup_runtime
    from msllm.config import load_config
    from msllm.convert.real_model import ensure_smollm2
    from msllm.generation.decode import Generator
    from msllm.generation.loading import load_for_inference
    from msllm.generation.passes import round_up

    cfg = load_config(os.path.join(common.ROOT, "configs", "smollm2", "run_smollm2_135m.yaml"),
                      ["--parallel_config.data_parallel=1", f"--model.model_config.param_init_type={a.dtype}"])
    setup_runtime(cfg, inference=True)
    ms.set_context(runtime_num_threads=a.threads)
    nets = []
    for fused in (False, True):
        net, mc, _ = load_for_inference(cfg, ensure_smollm2())
        if not fused:
            for layer in net.model.layers:
                layer.decode_front = layer.decode_back = None
        assert all(layer.fused_decode_ok() == fused for layer in net.model.layers)
        nets.append(Generator(net, mc))
    prompts = np.load(os.path.join(common.CACHE, f"decode_prompts_{a.prompt}x8.npz"))["ids"]
    total = a.rounds * a.steps + 1
    buffer = round_up(a.prompt + total)
    out = {"dtype": a.dtype, "prompt": a.prompt, "steps": a.steps, "rounds": a.rounds, "batches": {}}
    for b in a.batches:
        state = []
        for gen in nets:
            logits, caches, pads = gen.prefill(prompts[:b].tolist(), a.prompt, buffer, 0)
            tok = logits.argmax(-1)
            gen.decode_step(tok, a.prompt, pads, buffer, caches)       # compile outside the timing
            state.append({"gen": gen, "caches": caches, "pads": pads, "tok": tok, "slot": a.prompt,
                          "tokens": [], "ms": [], "round_ms": []})
        # restart both from the same point: re-prefill (the warm-up step wrote slot a.prompt)
        for s in state:
            logits, s["caches"], s["pads"] = s["gen"].prefill(prompts[:b].tolist(), a.prompt, buffer, 0)
            s["tok"] = logits.argmax(-1)
        for rnd in range(a.rounds):
            for s in (state if rnd % 2 == 0 else state[::-1]):
                times = []
                for _ in range(a.steps):
                    t0 = time.perf_counter()
                    logits, s["caches"] = s["gen"].decode_step(s["tok"], s["slot"], s["pads"], buffer, s["caches"])
                    times.append(time.perf_counter() - t0)
                    s["tok"] = logits.argmax(-1)
                    s["tokens"].append(s["tok"].tolist())
                    s["slot"] += 1
                s["ms"] += times
                s["round_ms"].append(1e3 * float(np.median(times)))
        A, B = (1e3 * float(np.median(s["ms"])) for s in state)
        rounds = [round(y / x, 3) for x, y in zip(state[0]["round_ms"], state[1]["round_ms"])]
        out["batches"][b] = {"A_unfused_ms": round(A, 2), "B_fused_ms": round(B, 2), "ratio_B_over_A": round(B / A, 3),
                             "round_ratios": rounds, "tokens_identical": state[0]["tokens"] == state[1]["tokens"]}
        print(f"b{b}: {out['batches'][b]}", flush=True)
    print("DECODE_AB " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
