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
step / peak (before the checkpoint save), parameter counts and the saved checkpoint's size.
"""

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402

sys.path.insert(0, common.ROOT)


def main():
    args = json.loads(sys.argv[1])
    spawn = args.get("spawn_time", T_START)
    s = common.shape(args["shape"])
    steps, warmup, pet = args["steps"], args["warmup"], args.get("pet")
    np = common.np
    t = time.perf_counter()
    import mindspore as ms
    from mindspore import Tensor, nn

    from msllm.cluster.context import setup_runtime
    from msllm.config import load_config
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.trainer import build_train_step
    import_s = time.perf_counter() - t
    rss = {"after_import": common.rss_mib()}

    t = time.perf_counter()
    o = common.OPTIM
    overrides = [
        "--parallel_config.data_parallel=1", f"--model.model_config.hidden_size={s['hidden_size']}",
        f"--model.model_config.num_layers={s['num_layers']}", f"--model.model_config.num_heads={s['num_heads']}",
        "--model.model_config.n_kv_heads=null", f"--model.model_config.intermediate_size={s['intermediate_size']}",
        f"--model.model_config.vocab_size={s['vocab_size']}", f"--model.model_config.seq_length={s['seq_length']}",
        f"--runner_config.batch_size={s['batch_size']}", f"--optimizer.betas=[{o['beta1']},{o['beta2']}]",
        f"--optimizer.eps={o['eps']}", f"--optimizer.weight_decay={o['weight_decay']}",
    ]
    if pet:
        overrides += ["--model.model_config.pet_config.pet_type=lora"] + \
            [f"--model.model_config.pet_config.{k}={v}" for k, v in pet.items()]
    cfg = load_config(os.path.join(common.ROOT, "configs", "llama", "run_llama_tiny.yaml"), overrides)
    setup_runtime(cfg)
    mc = cfg.model_config
    net = LlamaForCausalLM(mc, fast_paths=cfg.fast_paths)
    init = np.load(common.prepare_weights(args["shape"]))
    for p in net.get_parameters():
        p.set_data(Tensor(init[p.name]))
    total = sum(p.size for p in net.get_parameters())
    info = None
    if pet:
        from msllm.lora.apply import apply_lora

        info = apply_lora(net, mc.pet_config, seed=cfg.seed)
    params = net.trainable_params()
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    lr = Tensor(np.full(steps + warmup + 1, o["lr"], np.float32))
    opt = nn.AdamWeightDecay([g for g in groups if g["params"]], learning_rate=lr, beta1=o["beta1"],
                             beta2=o["beta2"], eps=o["eps"])
    step = build_train_step(net, opt, cfg, rt=type("RT", (), {"world_size": 1})())
    build_s = time.perf_counter() - t
    rss["after_build"] = common.rss_mib()

    data = common.batches(common.data_file(s["seq_length"]), s["batch_size"], warmup + steps)
    losses, times, cpus = [], [], []
    first_step_s = startup_to_first_step = None
    for i, (ids, lab) in enumerate(data):
        a, b = Tensor(ids), Tensor(lab)
        c0, t = time.process_time(), time.perf_counter()
        loss = step(a, b)[0]
        lv = float(loss.asnumpy())
        dt = time.perf_counter() - t
        cpus.append(time.process_time() - c0)
        if i == 0:
            rss["after_first_step"] = common.rss_mib()
            first_step_s, startup_to_first_step = dt, time.time() - spawn
        losses.append(lv)
        times.append(dt)
    peak = common.peak_rss_mib()  # before the checkpoint save, which copies what it writes
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as d:
        path = os.path.join(d, "checkpoint_0-1_1.ckpt")
        if pet:
            from msllm.lora.adapter import lora_record, save_adapter_checkpoint

            save_adapter_checkpoint(step, net, path, lora_record(mc.pet_config, info.modules, None), 1, 1,
                                    model_config=mc)
        else:
            ms.save_checkpoint(step, path)
        ckpt_bytes = os.path.getsize(path)
    med = common.median(times[warmup:])
    tokens = s["batch_size"] * s["seq_length"]
    trainable = sum(p.size for p in net.trainable_params())
    moments = sum(p.size for p in step.get_parameters() if p.name.startswith(("adam_m.", "adam_v.")))
    common.emit({
        "framework": args.get("name", "msllm"), "shape": args["shape"], "pet": pet, "mindspore": ms.__version__,
        "import_s": import_s, "build_s": build_s, "first_step_s": first_step_s,
        "startup_to_first_step_s": startup_to_first_step, "step_s_median": med, "step_s_all": times,
        "cpu_s_median": common.median(cpus[warmup:]), "tokens_per_s": tokens / med, "losses": losses,
        "peak_rss_mib": peak, "rss_mib": rss, "checkpoint_bytes": ckpt_bytes, "base_params": total,
        "trainable_params": trainable, "optimizer_state_elements": moments,
        "lora_modules": len(info.modules) if info else 0,
    })


if __name__ == "__main__":
    main()
