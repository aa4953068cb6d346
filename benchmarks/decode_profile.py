"""Where a batch-1 decode step's time goes (issue #32): the real SmolLM2-135M-Instruct at float32,
bfloat16 or int8 weights, a prompt of ``--prompt`` tokens prefilled into a cache, then ``--steps``
decode steps through the generator's compiled step, each timed; with ``MSLLM_KERNEL_PROFILE=1``
(set here) the wall time inside msllm's kernels per step, per kernel. The rest of the step is
MindSpore: its own operators (ScatterUpdate, Cast, Reshape, the rotary angles, the mask) and the
launch of every operator.

``--tiny``: the same 30-layer graph with hidden 64, 1 / 1 heads of 64, FFN 64, vocab 512
(random weights): every operator is launched as for SmolLM2 but does almost no work, so its step
is close to the launch cost of the graph; ``--layers N`` gives it N layers instead (how that cost
grows with the layers: their operators and their inputs).

    nice -n 19 .venv/bin/python benchmarks/decode_profile.py --dtype float32 --steps 40
    nice -n 19 .venv/bin/python benchmarks/decode_profile.py --tiny --steps 40

Prints one JSON line: median ms per step, kernel ms per step (sum and per kernel), the count of
kernel calls per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("MSLLM_KERNEL_PROFILE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def build(args):
    import mindspore as ms

    from msllm.cluster.context import setup_runtime
    from msllm.config import load_config
    from msllm.generation.loading import load_for_inference

    over = ["--parallel_config.data_parallel=1", f"--model.model_config.param_init_type={args.dtype}"]
    if args.tiny:
        from msllm.convert.verify import write_random_hf_dir

        d = os.path.join(HERE, ".cache", f"profile_tiny{args.layers}")
        if not os.path.exists(os.path.join(d, "config.json")):
            write_random_hf_dir(d, vocab_size=512, hidden_size=64, num_hidden_layers=args.layers, num_attention_heads=1,
                                num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True,
                                max_position_embeddings=2048)
        path = d
    else:
        from msllm.convert.real_model import ensure_smollm2

        path = ensure_smollm2()
    cfg = load_config(os.path.join(common.ROOT, "configs", "smollm2", "run_smollm2_135m.yaml"), over)
    setup_runtime(cfg, inference=True)
    ms.set_context(runtime_num_threads=args.threads)
    net, mc, _ = load_for_inference(cfg, path)
    return net, mc


def model_args(p: argparse.ArgumentParser, steps: int) -> argparse.ArgumentParser:
    """The options :func:`build` reads (``--dtype``, ``--tiny``, ``--threads``) and the decode run's
    ``--prompt`` / ``--steps``; shared with decode_call_overhead.py."""
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--layers", type=int, default=30, help="--tiny: decoder layers")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--threads", type=int, default=2)
    return p


def prefilled(args, batch: int, more_steps: int):
    """The model of ``args`` (:func:`build`) and its generator, ``batch`` prompts of ``args.prompt`` random
    token ids (seed 0, printed) prefilled into caches with room for ``more_steps`` + 8 decode steps, then 4
    decode steps to compile and warm up; shared with decode_call_overhead.py and decode_gemv_rows_ab.py.
    Returns (generator, next tokens (batch,), caches, pads, buffer, next slot)."""
    import numpy as np

    from msllm.generation.decode import generator_for
    from msllm.generation.passes import round_up

    net, mc = build(args)
    gen = generator_for(net, mc)
    rng = np.random.default_rng(0)
    print(f"seed 0; {batch} prompt(s) of {args.prompt} random token ids", flush=True)
    prompts = [rng.integers(1, min(mc.vocab_size, 30000), args.prompt).tolist() for _ in range(batch)]
    buffer = round_up(args.prompt + more_steps + 8)
    logits, caches, pads = gen.prefill(prompts, args.prompt, buffer, 0)
    tok = logits.argmax(-1)
    slot = args.prompt
    for _ in range(4):   # compile and warm up
        logits, caches = gen.decode_step(tok, slot, pads, buffer, caches)
        slot += 1
    return gen, tok, caches, pads, buffer, slot


def timed_steps(gen, tok, slot, pads, buffer, caches, steps: int):
    """``steps`` greedy decode steps through ``gen`` from token(s) ``tok`` (B,) at cache ``slot``, each
    timed; shared by the benchmarks that alternate blocks of steps in one process. Returns (median ms per
    step, the next tokens, the caches, the next slot)."""
    import numpy as np

    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits, caches = gen.decode_step(tok, slot, pads, buffer, caches)
        tok = logits.argmax(-1)
        walls.append(time.perf_counter() - t0)
        slot += 1
    return float(np.median(walls)) * 1e3, tok, caches, slot


def main(argv=None):
    p = model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), steps=40)
    p.add_argument("--out", default=None, help="append this run's row to this JSON list")
    a = p.parse_args(argv)
    common.use_repo()
    import numpy as np

    from msllm.generation.decode import generator_for
    from msllm.generation.passes import round_up
    from msllm.kernels import kernel_stats

    net, mc = build(a)
    gen = generator_for(net, mc)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, min(mc.vocab_size, 30000), a.prompt).tolist()
    buffer = round_up(a.prompt + a.steps + 4)
    logits, caches, pads = gen.prefill([prompt], a.prompt, buffer, 0)
    tok = np.array([int(logits[0].argmax())])
    walls, kern = [], []
    per_kernel: dict = {}
    for i in range(a.steps + 3):
        kernel_stats(reset=True)
        t0 = time.perf_counter()
        logits, caches = gen.decode_step(tok, a.prompt + i, pads, buffer, caches)
        walls.append(time.perf_counter() - t0)
        st = kernel_stats(reset=True)
        kern.append(sum(s for _, s in st.values()))
        if i >= 3:
            for k, (c, s) in st.items():
                pc, ps = per_kernel.get(k, (0, 0.0))
                per_kernel[k] = (pc + c, ps + s)
        tok = np.array([int(logits[0].argmax())])
    walls, kern = np.array(walls[3:]) * 1e3, np.array(kern[3:]) * 1e3
    n = len(walls)
    row = {"dtype": a.dtype, "tiny": a.tiny, "layers": a.layers if a.tiny else None,
           "decode_stack": os.environ.get("MSLLM_DECODE_STACK", "1") != "0",
           "stacked_weights": os.environ.get("MSLLM_STACK_WEIGHTS", "1") != "0", "prompt": a.prompt, "steps": n,
           "step_ms_median": round(float(np.median(walls)), 3), "kernel_ms_median": round(float(np.median(kern)), 3),
           "other_ms_median": round(float(np.median(walls - kern)), 3),
           "kernels": {k: {"calls_per_step": c / n, "ms_per_step": round(s * 1e3 / n, 3)}
                       for k, (c, s) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])}}
    print("DECODE_PROFILE " + json.dumps(row))
    if a.out:   # one more row in a JSON list (several runs: layer counts, the stack on and off)
        import harness

        rows = []
        if os.path.exists(a.out):
            with open(a.out) as fh:
                rows = json.load(fh)
        harness.write_json(a.out, rows + [dict(row, machine=common.machine(), command=" ".join(sys.argv))])


if __name__ == "__main__":
    main()
