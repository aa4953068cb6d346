"""Compile every layout variant msllm offers with MindSpore's dry-run, one rank each (issue #30).

Usage::

    python tools/dryrun_layouts.py [--only NAME ...] [--rank R] [--output_dir DIR] [--json OUT]

Each variant is the tiny LLaMA (configs/llama/run_llama_tiny.yaml, seq 64) on dp2 x mp2 x pp2 (8
ranks, 2 micro batches) plus the overrides below; one rank (default 5, stage 1) is compiled at
simulation level 1 by ``run_msllm.py --sim_level 1 --sim_rank_id R``. Prints one line per variant
(compiled or MindSpore's message) and optionally writes them as JSON. A compile takes about a
minute on 2 cores; run it in the background.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--parallel.parallel_mode=1", "--parallel.full_batch=True", "--parallel_config.data_parallel=2",
        "--parallel_config.model_parallel=2", "--parallel_config.pipeline_stage=2",
        "--parallel_config.micro_batch_num=2", "--runner_config.batch_size=1", "--model.model_config.seq_length=64"]
MC = "--model.model_config."
VARIANTS = {
    "base": [],
    "no_pipeline": ["--parallel_config.pipeline_stage=1", "--parallel_config.data_parallel=4",
                    "--parallel_config.micro_batch_num=1"],
    "vocab_emb_dp_false": ["--parallel_config.vocab_emb_dp=False"],
    "optimizer_shard": ["--parallel_config.optimizer_shard=True"],
    "use_seq_parallel": ["--parallel_config.use_seq_parallel=True"],
    "recompute": ["--recompute_config.recompute=True"],
    "select_recompute": ["--recompute_config.select_recompute=True"],
    # FlashAttentionScore takes fp16/bf16 (msllm refuses it with float32 compute)
    "flash_attention": [f"{MC}use_flash_attention=True", f"{MC}compute_dtype=float16"],
    "fused_rms_norm": [f"{MC}fused_rms_norm=True"],
    "qwen2_biases": [f"{MC}model_type=qwen2", f"{MC}qkv_has_bias=True"],
    "qwen3_qk_norm": [f"{MC}qk_norm=True"],
    # tied embeddings across pipeline stages are refused by msllm: Gemma compiles without stages
    "gemma": ["--parallel_config.pipeline_stage=1", "--parallel_config.data_parallel=4",
              "--parallel_config.micro_batch_num=1", f"{MC}rms_norm_offset=1.0", f"{MC}hidden_act=gelu_pytorch_tanh", f"{MC}embedding_multiplier=11.3",
              f"{MC}tie_word_embeddings=True"],
    # LoRA rank 8 on the attention projections (the frozen base is not read in a dry-run)
    "lora": [f"{MC}pet_config={{pet_type: lora, lora_rank: 8, lora_alpha: 16, target_modules: '.*wq|.*wv'}}"],
    "moe_expert_parallel": ["--parallel_config.pipeline_stage=1", "--parallel_config.data_parallel=4",
                            "--parallel_config.micro_batch_num=1",
                            "--parallel_config.expert_parallel=2",
                            f"{MC}moe_config={{expert_num: 4, num_experts_chosen: 2}}"],
}


def run(name: str, rank: int, out: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config",
           os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"), "--run_mode", "train", "--sim_level", "1",
           "--sim_rank_id", str(rank), "--sim_jobs", "1", *BASE, *VARIANTS[name], f"--output_dir={out}/{name}"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    row = {"variant": name, "overrides": VARIANTS[name], "rank": rank, "ok": proc.returncode == 0,
           "seconds": round(time.time() - t0, 1), "row": proc.stdout.strip().splitlines()[-1:] or [""],
           "error": None if proc.returncode == 0 else tail[-600:]}
    print(f"{name:22} {'compiled' if row['ok'] else 'FAILED'} in {row['seconds']} s  "
          f"{row['row'][0] if row['ok'] else row['error']}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="variants to compile (default: all)")
    p.add_argument("--rank", type=int, default=5)
    p.add_argument("--output_dir", default="output/dryrun_layouts")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    for name in args.only or VARIANTS:
        rows.append(run(name, args.rank, os.path.abspath(args.output_dir)))
        if args.json:  # after every variant, atomically: a long sweep stopped early keeps its rows
            with open(args.json + ".tmp", "w") as fh:
                json.dump(rows, fh, indent=1)
            os.replace(args.json + ".tmp", args.json)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
