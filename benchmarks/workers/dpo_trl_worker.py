"""TRL ``DPOTrainer`` training-step worker for benchmarks/dpo_speed.py (TRL 1.16, transformers, torch eager,
2 threads, fp32 (``bf16=False``: TRL's configs default to bf16, which on CPU runs the reference under bf16
autocast; ``"bf16": true`` in the arguments asks for it: the bf16-compute variants), AdamW, ``max_grad_norm`` 1.0 as msllm's run YAML), on the same TRL conversational pairs msllm's
MindRecord was made from, ``max_length`` = seq + 1 (msllm's rows), full fine-tuning (a reference copy:
TRL's default) or LoRA (PEFT r 8, alpha 16, q/k/v/o, no dropout; the reference is the base with the adapter
disabled). TRL is imported through tests/helpers/trl_env.py (a private pyarrow 21 beside numpy<2).

Usage: python dpo_trl_worker.py '{"hf_dir": ..., "pairs": train.jsonl, "seq": 128, "batch": 2, "steps": 4,
        "warmup": 1, "lora": false, "precompute_ref": false, "name": ..., "spawn_time": ...}'

Timed: ``training_step`` (forward of policy and reference, backward: ``step_s`` / ``tokens_per_s``, in TRL's
favour, msllm's timed step includes its update), and the update the Trainer's loop runs after it (gradient clipping
and AdamW's step, up to the optimizer's post-step hook: ``update_s``); ``tokens_per_s_with_update`` over both is the
like-for-like figure.
Tokens of a step: the attention mask's sum over the chosen and rejected sequences (no padding). Prints one
``BENCH_RESULT {json}`` line (fields as dpo_msllm_worker.py).
"""

import json
import os
import sys
import time

import worker_common as wc  # first: takes the process start time

common = wc.common


def main():
    args = wc.worker_args()
    sys.path.insert(0, os.path.join(common.ROOT, "tests"))
    from helpers.trl_env import trl_importable

    trl_importable()
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    with open(args["pairs"], encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    model = AutoModelForCausalLM.from_pretrained(args["hf_dir"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args["hf_dir"])
    peft_config = None
    if args["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    times, tokens, updates = [], [], []
    ended = [0.0]

    class Timed(trl.DPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs.get("attention_mask")
            tokens.append(int(mask.sum()) if mask is not None else -1)
            t = time.perf_counter()
            loss = super().training_step(model, inputs, num_items_in_batch)
            ended[0] = time.perf_counter()
            times.append(ended[0] - t)
            print(f"step {len(times)}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
            return loss

        def create_optimizer(self, *a, **kw):
            # the update the Trainer runs after training_step: gradient clipping, then AdamW's step,
            # timed from the end of training_step to the optimizer's post-step hook (msllm's timed
            # step includes both)
            opt = super().create_optimizer(*a, **kw)
            opt.register_step_post_hook(lambda *_: updates.append(time.perf_counter() - ended[0]))
            return opt

    cfg = trl.DPOConfig(output_dir=os.path.join(os.getcwd(), "out"), per_device_train_batch_size=args["batch"],
                        max_length=args["seq"] + 1, beta=0.1, learning_rate=5e-6, max_steps=args["steps"] + args["warmup"],
                        max_grad_norm=1.0, report_to="none", use_cpu=True, seed=0, save_strategy="no",
                        logging_steps=1, bf16=bool(args.get("bf16")), precompute_ref_log_probs=bool(args.get("precompute_ref")),
                        dataloader_num_workers=0)
    t0 = time.perf_counter()
    trainer = Timed(model=model, args=cfg, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok,
                    peft_config=peft_config)
    setup_s = time.perf_counter() - t0
    trainer.train()
    w = args["warmup"]
    step_s = common.median(times[w:])
    whole = common.median([a + b for a, b in zip(times[w:], updates[w:])]) if len(updates) == len(times) else None
    common.emit({"name": args["name"], "setup_s": setup_s, "first_step_s": times[0], "step_s_median": step_s,
                 "step_s": times, "update_s": updates, "tokens": tokens, "ref_model_is_none": trainer.ref_model is None,
                 "tokens_per_s": sum(tokens[w:]) / len(tokens[w:]) / step_s, "pairs_per_s": args["batch"] / step_s,
                 "step_with_update_s_median": whole,
                 "tokens_per_s_with_update": sum(tokens[w:]) / len(tokens[w:]) / whole if whole else None,
                 "peak_rss_mib": common.peak_rss_mib()})


if __name__ == "__main__":
    main()
