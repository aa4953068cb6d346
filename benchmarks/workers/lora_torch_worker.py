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

import os
import tempfile

import worker_common as wc  # first: takes the process start time

common = wc.common


def main():
    args, s, steps, warmup = wc.train_args()
    pet = args.get("pet")
    phases = wc.Phases()
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401  (used by wc.hf_llama; import time counted here)
    if pet:
        import peft
    phases.mark("import")

    torch.set_num_threads(int(args.get("threads", 2)))
    torch.manual_seed(0)
    hf_dir = args.get("hf_dir")
    if hf_dir:  # a real model: its own weights and config (tied embeddings), SDPA attention
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
        model.config.use_cache = False
    else:
        model = wc.hf_llama(s)
        wc.load_torch_weights(torch, model, args["shape"])
    total = sum(p.numel() for p in model.parameters())
    if pet:
        model = peft.get_peft_model(model, peft.LoraConfig(r=pet["lora_rank"], lora_alpha=pet["lora_alpha"],
                                                           lora_dropout=pet["lora_dropout"],
                                                           target_modules=pet["targets"]))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    adamw_step, state = wc.torch_adamw(torch, trainable)
    clip = args.get("clip_grad_norm")
    phases.mark("build")

    def one_step(tokens, targets):
        for p in trainable:
            p.grad = None
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)
        loss.backward()
        if clip:  # as msllm's runner_wrapper use_clip_grad / HF Trainer's max_grad_norm
            torch.nn.utils.clip_grad_norm_(trainable, clip, foreach=True)
        adamw_step()
        return float(loss.detach())

    timing = wc.timed_steps(wc.train_batches(s, warmup + steps), lambda ids, lab: wc.torch_targets(torch, ids, lab),
                            one_step, warmup, s["batch_size"] * s["seq_length"], wc.spawn_time(args), phases.rss)
    peak = common.peak_rss_mib()  # before the checkpoint save
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
    common.emit({
        "framework": args.get("name", "torch"), "shape": args["shape"], "pet": pet, "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__ if pet else None,
        "threads": torch.get_num_threads(), **phases.fields(), **timing,
        "peak_rss_mib": peak, "checkpoint_bytes": ckpt_bytes,
        "base_params": total, "trainable_params": sum(p.numel() for p in trainable),
        "optimizer_state_elements": 2 * sum(p.numel() for p in trainable), "hf_dir": hf_dir,
        "clip_grad_norm": clip, "tied_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
    })


if __name__ == "__main__":
    main()
