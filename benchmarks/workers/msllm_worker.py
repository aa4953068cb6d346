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

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402

sys.path.insert(0, common.ROOT)


def main():
    args = json.loads(sys.argv[1])
    spawn = args.get("spawn_time", T_START)
    s = common.shape(args["shape"])
    steps, warmup = args["steps"], args["warmup"]
    t = time.perf_counter()
    import mindspore as ms
    from mindspore import Tensor

    from msllm.cluster.context import setup_runtime
    from msllm.config import load_config
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.trainer import build_optimizer, build_train_step
    import_s = time.perf_counter() - t
    rss = {"after_import": common.rss_mib()}

    t = time.perf_counter()
    o = common.OPTIM
    overrides = [
        "--parallel_config.data_parallel=1",
        f"--model.model_config.hidden_size={s['hidden_size']}",
        f"--model.model_config.num_layers={s['num_layers']}",
        f"--model.model_config.num_heads={s['num_heads']}",
        "--model.model_config.n_kv_heads=null",
        f"--model.model_config.intermediate_size={s['intermediate_size']}",
        f"--model.model_config.vocab_size={s['vocab_size']}",
        f"--model.model_config.seq_length={s['seq_length']}",
        f"--runner_config.batch_size={s['batch_size']}",
        f"--optimizer.betas=[{o['beta1']},{o['beta2']}]",
        f"--optimizer.eps={o['eps']}",
        f"--optimizer.weight_decay={o['weight_decay']}",
    ]
    if args.get("jit_level"):
        overrides.append(f"--context.jit_level={args['jit_level']}")
    if args.get("variant") == "noscale":
        overrides += ["--runner_wrapper.loss_scale=none", "--runner_wrapper.use_clip_grad=False"]
    cfg = load_config(os.path.join(common.ROOT, "configs", "llama", "run_llama_tiny.yaml"), overrides)
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
    init = common.np.load(common.prepare_weights(args["shape"]))
    params = {p.name: p for p in net.trainable_params()}
    assert set(params) == set(init.files), sorted(set(params) ^ set(init.files))[:5]
    for name, p in params.items():
        p.set_data(Tensor(init[name]))
    lr = common.np.full(steps + warmup + 1, o["lr"], common.np.float32)
    opt = build_optimizer(net, cfg, lr)
    step = build_train_step(net, opt, cfg, rt=type("RT", (), {"world_size": 1})())
    build_s = time.perf_counter() - t
    rss["after_build"] = common.rss_mib()

    data = common.batches(common.data_file(s["seq_length"]), s["batch_size"], warmup + steps)
    losses, times, cpus = [], [], []
    first_step_s = None
    startup_to_first_step = None
    for i, (ids, lab) in enumerate(data):
        a, b = Tensor(ids), Tensor(lab)
        c0, t = time.process_time(), time.perf_counter()
        loss, overflow, scale, norm = step(a, b)
        lv = float(loss.asnumpy())
        dt = time.perf_counter() - t
        cpus.append(time.process_time() - c0)
        if i == 0:
            rss["after_first_step"] = common.rss_mib()
            first_step_s = dt
            startup_to_first_step = time.time() - spawn
        losses.append(lv)
        times.append(dt)
    meas = times[warmup:]
    tokens = s["batch_size"] * s["seq_length"]
    med = common.median(meas)
    common.emit({
        "framework": args.get("name") or ("msllm" if args.get("variant", "default") == "default"
                                         else f"msllm-{args['variant']}"),
        "compact_loss": bool(net.compact_loss),
        "variant": args.get("variant", "default"), "shape": args["shape"],
        "mindspore": ms.__version__, "import_s": import_s, "build_s": build_s,
        "first_step_s": first_step_s, "startup_to_first_step_s": startup_to_first_step,
        "step_s_median": med, "step_s_all": times, "cpu_s_median": common.median(cpus[warmup:]), "cpu_s_all": cpus, "tokens_per_s": tokens / med,
        "losses": losses, "peak_rss_mib": common.peak_rss_mib(), "rss_mib": rss,
        "jit_level": cfg.context.jit_level, "kernels": net.kernels.describe(),
        "model_config_overrides": args.get("model_config", {}),
    })


if __name__ == "__main__":
    main()
