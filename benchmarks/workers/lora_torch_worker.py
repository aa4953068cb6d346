"""transformers + PEFT LoRA (or full) fine-tuning step worker for benchmarks/lora_speed.py: HF
``LlamaForCausalLM`` of the benchmark shape (SDPA attention, fp32, eager), the same initial weights
as msllm's worker, ``peft.get_peft_model`` with the same rank / alpha / dropout / targets
(PEFT's own initialisation: A Kaiming-uniform, B zero), and the AdamW of
benchmarks/workers/torch_worker.py (MindSpore AdamWeightDecay semantics, ``torch._foreach_*``)
over the trainable parameters only. ``torch.set_num_threads(2)``.

Usage: python lora_torch_worker.py '{"shape": "medium", "steps": 4, "warmup": 2,
        "pet": {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.05, "targets": ["q_proj", ...]} | null,
        "name": "...", "spawn_time": ...}'
Prints one ``BENCH_RESULT {json}`` line (fields as lora_msllm_worker.py). The checkpoint size is
``save_pretrained``'s ``adapter_model.safetensors`` for PEFT, and model + AdamW moments written
with safetensors for full fine-tuning.
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


def main():
    args = json.loads(sys.argv[1])
    spawn = args.get("spawn_time", T_START)
    s = common.shape(args["shape"])
    steps, warmup, pet = args["steps"], args["warmup"], args.get("pet")
    np = common.np
    t = time.perf_counter()
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    if pet:
        import peft
    import_s = time.perf_counter() - t
    rss = {"after_import": common.rss_mib()}

    t = time.perf_counter()
    torch.set_num_threads(int(args.get("threads", 2)))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                      intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
                      num_attention_heads=s["num_heads"], num_key_value_heads=s["num_heads"],
                      max_position_embeddings=s["seq_length"], rms_norm_eps=common.RMS_EPS, rope_theta=10000.0,
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False, use_cache=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).float()
    init = np.load(common.prepare_weights(args["shape"]))
    sd = {k.replace("embed_tokens.embedding_table", "embed_tokens.weight"): torch.from_numpy(init[k].copy())
          for k in init.files}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not [m for m in missing if "rotary_emb" not in m] and not unexpected
    total = sum(p.numel() for p in model.parameters())
    if pet:
        model = peft.get_peft_model(model, peft.LoraConfig(r=pet["lora_rank"], lora_alpha=pet["lora_alpha"],
                                                           lora_dropout=pet["lora_dropout"],
                                                           target_modules=pet["targets"]))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    o = common.OPTIM
    groups = [([p for p in trainable if p.ndim >= 2], o["weight_decay"]), ([p for p in trainable if p.ndim < 2], 0.0)]
    groups = [g for g in groups if g[0]]
    state = {id(p): (torch.zeros_like(p), torch.zeros_like(p)) for p in trainable}

    @torch.no_grad()
    def adamw_step():
        for params, wd in groups:
            g = [p.grad for p in params]
            m = [state[id(p)][0] for p in params]
            v = [state[id(p)][1] for p in params]
            torch._foreach_mul_(m, o["beta1"])
            torch._foreach_add_(m, g, alpha=1 - o["beta1"])
            torch._foreach_mul_(v, o["beta2"])
            torch._foreach_addcmul_(v, g, g, value=1 - o["beta2"])
            upd = torch._foreach_sqrt(v)
            torch._foreach_add_(upd, o["eps"])
            upd = torch._foreach_div(m, upd)
            if wd:
                torch._foreach_add_(upd, params, alpha=wd)
            torch._foreach_add_(params, upd, alpha=-o["lr"])

    build_s = time.perf_counter() - t
    rss["after_build"] = common.rss_mib()
    data = common.batches(common.data_file(s["seq_length"]), s["batch_size"], warmup + steps)
    losses, times, cpus = [], [], []
    first_step_s = startup_to_first_step = None
    for i, (ids, lab) in enumerate(data):
        tokens = torch.from_numpy(ids[:, :-1].astype(np.int64))
        targets = torch.from_numpy(lab[:, 1:].astype(np.int64))
        c0, t = time.process_time(), time.perf_counter()
        for p in trainable:
            p.grad = None
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)
        loss.backward()
        adamw_step()
        lv = float(loss.detach())
        dt = time.perf_counter() - t
        cpus.append(time.process_time() - c0)
        if i == 0:
            rss["after_first_step"] = common.rss_mib()
            first_step_s, startup_to_first_step = dt, time.time() - spawn
        losses.append(lv)
        times.append(dt)
    peak = common.peak_rss_mib()
    with tempfile.TemporaryDirectory(prefix="peft_bench_") as d:
        if pet:
            model.save_pretrained(d)
            ckpt_bytes = os.path.getsize(os.path.join(d, "adapter_model.safetensors"))
        else:
            from safetensors.torch import save_file

            tensors = {n: p.detach() for n, p in model.named_parameters()}
            for n, p in model.named_parameters():
                tensors[f"adam_m.{n}"], tensors[f"adam_v.{n}"] = state[id(p)]
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(d, "full.safetensors"))
            ckpt_bytes = os.path.getsize(os.path.join(d, "full.safetensors"))
    med = common.median(times[warmup:])
    import transformers
    common.emit({
        "framework": args.get("name", "torch"), "shape": args["shape"], "pet": pet, "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__ if pet else None,
        "threads": torch.get_num_threads(), "import_s": import_s, "build_s": build_s, "first_step_s": first_step_s,
        "startup_to_first_step_s": startup_to_first_step, "step_s_median": med, "step_s_all": times,
        "cpu_s_median": common.median(cpus[warmup:]), "tokens_per_s": s["batch_size"] * s["seq_length"] / med,
        "losses": losses, "peak_rss_mib": peak, "rss_mib": rss, "checkpoint_bytes": ckpt_bytes,
        "base_params": total, "trainable_params": sum(p.numel() for p in trainable),
        "optimizer_state_elements": 2 * sum(p.numel() for p in trainable),
    })


if __name__ == "__main__":
    main()
