"""msllm training-step worker: LlamaForCausalLM + TrainStep exactly as ``msllm.training.trainer``
builds them (``setup_runtime``, ``build_optimizer``, ``build_train_step`` from a RunConfig made
from configs/llama/run_llama_tiny.yaml with the benchmark's shapes), in GRAPH_MODE.

Usage: python msllm_worker.py '{"shape": "tiny", "steps": 20, "warmup": 3, "variant": "default",
                                "spawn_time": <time.time() of the parent at spawn>}'
variant: ``default`` (the YAML's dynamic loss scale 65536 + clip 1.0) or ``noscale``
(``loss_scale: none``, no clipping: the same update as MindFormers' plain TrainOneStepCell).
``compact_loss``: false = dense output head over every position, as MindFormers computes it.
``name``: the label reported (default msllm / msllm-<variant>).
Extra keys: ``jit_level`` (O0/O1), ``threads`` (runtime_num_threads), ``context`` (dict passed
to ms.set_context after setup_runtime), ``model_config`` (dict of model_config attributes, e.g.
``{"cpu_kernels": false}`` for MindSpore's operators only).
Prints one ``BENCH_RESULT {json}`` line.
"""

import worker_common as wc  # first: takes the process start time

common = wc.common


def main():
    args, s, steps, warmup = wc.train_args()
    phases = wc.Phases()
    import mindspore as ms
    from mindspore import Tensor

    common.use_repo()
    from msllm.cluster.context import setup_runtime
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.setup import build_optimizer, build_train_step
    phases.mark("import")

    overrides = []
    if args.get("jit_level"):
        overrides.append(f"--context.jit_level={args['jit_level']}")
    if args.get("variant") == "noscale":
        overrides += ["--runner_wrapper.loss_scale=none", "--runner_wrapper.use_clip_grad=False"]
    cfg = wc.msllm_run_config(s, overrides)
    # model_config keys this benchmark varies (cpu_kernels, use_flash_attention, fused_rms_norm)
    for key, value in args.get("model_config", {}).items():
        if not hasattr(cfg.model_config, key):
            raise SystemExit(f"model_config key {key!r} is not a LlamaConfig field")
        setattr(cfg.model_config, key, value)
    setup_runtime(cfg)
    if args.get("threads"):
        ms.set_context(runtime_num_threads=int(args["threads"]))
    if args.get("context"):
        ms.set_context(**args["context"])
    # compact_loss None = the model's default (with the CPU fast paths: head + loss on target
    # positions only)
    net = LlamaForCausalLM(cfg.model_config, compact_loss=args.get("compact_loss"), fast_paths=cfg.fast_paths)
    common.set_ms_weights(net.trainable_params(), common.np.load(common.prepare_weights(args["shape"])))
    lr = common.np.full(steps + warmup + 1, common.OPTIM["lr"], common.np.float32)
    opt = build_optimizer(net, cfg, lr)
    step = build_train_step(net, opt, cfg, rt=wc.single_process())
    phases.mark("build")

    def one_step(a, b):
        loss, overflow, scale, norm = step(a, b)
        return float(loss.asnumpy())

    timing = wc.timed_steps(wc.train_batches(s, warmup + steps), lambda ids, lab: (Tensor(ids), Tensor(lab)),
                            one_step, warmup, s["batch_size"] * s["seq_length"], wc.spawn_time(args), phases.rss)
    common.emit({
        "framework": args.get("name") or ("msllm" if args.get("variant", "default") == "default"
                                         else f"msllm-{args['variant']}"),
        "compact_loss": bool(net.compact_loss),
        "variant": args.get("variant", "default"), "shape": args["shape"],
        "mindspore": ms.__version__, **phases.fields(), **timing,
        "peak_rss_mib": common.peak_rss_mib(),
        "jit_level": cfg.context.jit_level, "kernels": net.kernels.describe(),
        "model_config_overrides": args.get("model_config", {}),
    })


if __name__ == "__main__":
    main()
