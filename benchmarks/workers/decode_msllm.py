"""msllm decode worker: the model loaded the way predict loads it (``load_for_inference`` of an HF
directory, converted in memory), then ``Generator.generate`` (GRAPH_MODE, greedy, no EOS stop)
on the benchmark's prompts, once cold (compiles the prefill and decode graphs) and ``reps`` times
warm.

Usage: python decode_msllm.py '{"model_dir": ..., "prompts": ".npz", "batch": 1, "new": 128,
                                "reps": 3, "use_past": true, "threads": 2, "spawn_time": ...}'
``fast_paths``: false builds the model without its CPU fast paths / msllm kernels (default: the
run config's choice, True on CPU); ``overrides``: run-config overrides (``--section.key=value``,
e.g. ``param_init_type=bfloat16``).
Prints one ``BENCH_RESULT {json}`` line: per warm run the time to first token (prefill + first
token) and decode tokens/s (B x (new - 1) tokens after the first, over their wall time); the
cold run's extra time = compile time; the new tokens of row 0 (to check against transformers);
peak RSS.
"""

import os

import worker_common as wc  # first: takes the process start time

common = wc.common


def main():
    args = wc.worker_args()
    phases = wc.Phases()
    import numpy as np

    import mindspore as ms

    common.use_repo()
    from msllm.cluster.context import setup_runtime
    from msllm.config import load_config
    from msllm.config_generation import GenerationConfig, resolve_settings
    from msllm.generation.decode import generator_for
    from msllm.generation.loading import load_for_inference
    phases.mark("import")

    cfg = load_config(os.path.join(common.ROOT, "configs", "llama", "run_llama_tiny.yaml"),
                      ["--parallel_config.data_parallel=1"] + list(args.get("overrides", [])))
    setup_runtime(cfg, inference=True)
    if args.get("threads"):
        ms.set_context(runtime_num_threads=int(args["threads"]))
    net, mc, _ = load_for_inference(cfg, args["model_dir"], fast_paths=args.get("fast_paths"))
    phases.mark("build")
    prompts = np.load(args["prompts"])["ids"][:args["batch"]].tolist()
    gen = generator_for(net, mc)
    s = resolve_settings(GenerationConfig(max_new_tokens=args["new"], eos_token_id=[],
                                          use_past=bool(args.get("use_past", True))), mc)
    runs = []
    for rep in range(1 + args["reps"]):
        r = gen.generate(prompts, s)
        runs.append({"ttft_s": r.prefill_s, "decode_s": r.decode_s, "steps": r.steps,
                     "decode_tokens_per_s": len(prompts) * r.steps / r.decode_s})
        assert all(len(x) == args["new"] for x in r.tokens)
    common.emit({
        "framework": "msllm" if args.get("use_past", True) else "msllm-nocache", "fast_paths": args.get("fast_paths"),
        "batch": len(prompts), "prompt_tokens": len(prompts[0]), "new_tokens": args["new"],
        **wc.decode_summary(runs, args), "graphs": [list(k) for k in gen.shapes],
        "tokens_row0": r.tokens[0], **phases.fields(),
        "threads": int(args.get("threads") or 0)})


if __name__ == "__main__":
    main()
