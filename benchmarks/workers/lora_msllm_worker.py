"""msllm LoRA (or full) fine-tuning step worker for benchmarks/lora_speed.py.

The model, optimizer and train step are built as ``msllm.training.trainer`` builds them (RunConfig
from configs/llama/run_llama_tiny.yaml with the benchmark's shape, ``build_train_step``), GRAPH_MODE;
with ``pet`` the LoRA set-up is ``msllm.lora.apply.apply_lora`` on the loaded base (what
``msllm.lora.training.LoraTraining`` does after loading ``load_checkpoint``). AdamW is the trainer's
``build_optimizer`` minus its empty weight-decay group (LoRA has only matrices; the trainer keeps an
empty group, which MindSpore refuses, until that is changed).

Usage: python lora_msllm_worker.py '{"shape": "medium", "steps": 4, "warmup": 2,
        "pet": {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ".*wq|.*wk|.*wv|.*wo"}
               | null, "name": "...", "spawn_time": ...}'
Prints one ``BENCH_RESULT {json}`` line: tokens/s, step times, RSS after import / build / first
step / peak (before the checkpoint save), parameter counts and the saved checkpoint's size; with
``"compact_loss": false`` the output head runs at every position (like transformers; the
default is the model's, the compact loss: the head only at positions with a target); with
``"kernel_stats": true`` also the milliseconds per step in each of msllm's CPU kernels
(``MSLLM_KERNEL_PROFILE=1``; the timing itself slows the step, so such a run is a profile, not a speed).
"""

import os
import tempfile

import worker_common as wc  # first: takes the process start time

common = wc.common


def main():
    args, s, steps, warmup = wc.train_args()
    if args.get("kernel_stats"):   # time every msllm kernel call (read when the library loads)
        os.environ["MSLLM_KERNEL_PROFILE"] = "1"
    pet = args.get("pet")
    phases = wc.Phases()
    import mindspore as ms
    from mindspore import Tensor

    common.use_repo()
    from msllm.cluster.context import setup_runtime
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.setup import build_train_step
    phases.mark("import")

    overrides = []
    if pet:
        overrides += ["--pet_config.pet_type=lora"] + [f"--pet_config.{k}={v}" for k, v in pet.items()]
    hf_dir = args.get("hf_dir")
    if hf_dir:  # a real model: its run YAML, load_checkpoint = the HF directory (shape from config.json)
        from msllm.config import load_config
        from msllm.convert.starting import load_base_into
        from msllm.training.sources import adopt_hf_model_config

        o = common.OPTIM
        cfg = load_config(os.path.join(common.ROOT, args["config"]), [
            f"--load_checkpoint={hf_dir}", "--parallel_config.data_parallel=1",
            f"--model.model_config.seq_length={s['seq_length']}", f"--runner_config.batch_size={s['batch_size']}",
            f"--optimizer.betas=[{o['beta1']},{o['beta2']}]", f"--optimizer.eps={o['eps']}",
            f"--optimizer.weight_decay={o['weight_decay']}"] + overrides)
        cfg = adopt_hf_model_config(cfg)
        setup_runtime(cfg)
        mc = cfg.model_config
        net = LlamaForCausalLM(mc, compact_loss=args.get("compact_loss"), fast_paths=cfg.fast_paths,
                               device=cfg.context.device_target)
        load_base_into(net, hf_dir)
    else:
        cfg = wc.msllm_run_config(s, overrides)
        setup_runtime(cfg)
        mc = cfg.model_config
        net = LlamaForCausalLM(mc, compact_loss=args.get("compact_loss"), fast_paths=cfg.fast_paths)
        common.set_ms_weights(net.get_parameters(), common.np.load(common.prepare_weights(args["shape"])))
    total = sum(p.size for p in net.get_parameters())
    info = None
    if pet:
        from msllm.lora.apply import apply_lora

        info = apply_lora(net, cfg.pet_config, seed=cfg.seed)
    opt = common.ms_adamw(net.trainable_params(), steps + warmup + 1)
    step = build_train_step(net, opt, cfg, rt=wc.single_process())
    phases.mark("build")

    timing = wc.timed_steps(wc.train_batches(s, warmup + steps), lambda ids, lab: (Tensor(ids), Tensor(lab)),
                            lambda a, b: float(step(a, b)[0].asnumpy()), warmup, s["batch_size"] * s["seq_length"],
                            wc.spawn_time(args), phases.rss)
    peak = common.peak_rss_mib()  # before the checkpoint save, which copies what it writes
    kernel_ms = None
    if args.get("kernel_stats"):  # per step over every step run (no kernel runs while compiling)
        from msllm.kernels import kernel_stats

        kernel_ms = {k: 1e3 * sec / (warmup + steps) for k, (_, sec) in kernel_stats().items()}
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as d:
        path = os.path.join(d, "checkpoint_0-1_1.ckpt")
        if pet:
            from msllm.lora.adapter import lora_record, save_adapter_checkpoint

            save_adapter_checkpoint(step, net, path, lora_record(cfg.pet_config, info.modules, None), 1, 1,
                                    model_config=mc)
        else:
            ms.save_checkpoint(step, path)
        ckpt_bytes = os.path.getsize(path)
    trainable = sum(p.size for p in net.trainable_params())
    moments = sum(p.size for p in step.get_parameters() if p.name.startswith(("adam_m.", "adam_v.")))
    common.emit({
        "framework": args.get("name", "msllm"), "shape": args["shape"], "pet": pet, "mindspore": ms.__version__,
        **phases.fields(), **timing,
        "peak_rss_mib": peak, "checkpoint_bytes": ckpt_bytes, "base_params": total,
        "trainable_params": trainable, "optimizer_state_elements": moments,
        "lora_modules": len(info.modules) if info else 0, "compact_loss": bool(net.compact_loss), "hf_dir": hf_dir, "kernel_ms_per_step": kernel_ms,
        "model": {"layers": mc.num_layers, "hidden": mc.hidden_size, "heads": mc.num_heads, "kv_heads": mc.kv_heads,
                  "vocab": mc.vocab_size, "seq_length": mc.seq_length},
        "runner_wrapper": {k: getattr(cfg.runner_wrapper, k, None) for k in ("loss_scale", "use_clip_grad",
                                                                              "max_grad_norm")},
    })


if __name__ == "__main__":
    main()
