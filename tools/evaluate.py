#!/usr/bin/env python
"""Evaluate a LLaMA checkpoint on a benchmark, scored as lm-evaluation-harness v0.4 does.

    python tools/evaluate.py --config CONFIG --load_checkpoint CKPT --task mmlu --data_dir DIR
        [--num_fewshot 5] [--limit N] [--batch_size B] [--stride S] [--tokenizer tokenizer.model]
        [--adapter LORA.ckpt] [--max_gen_toks 256] [--max_length N] [--reuse_prefix] [--dense_head] [--section.key=value ...]

Tasks: ``mmlu`` (DIR/{dev,test}/{subject}_{split}.csv), ``ceval`` (DIR/{dev,val}/...csv),
``boolq`` (DIR/{train,dev}.jsonl), ``gsm8k`` (DIR/{train,test}.jsonl), ``mc`` (own multiple-choice
JSONL: a file, or DIR/{dev,test}.jsonl), ``ppl`` (a .txt or .jsonl file; sliding window).
``--load_checkpoint`` takes what predict takes: an msllm or MindFormers-named checkpoint (file or
run directory) or a Hugging Face model directory. Output: a summary line (and per-subject table),
``output_dir/eval/results_{task}_{time}.json`` with every request's scores. Data parallel:
``MSLLM_ENTRY=tools/evaluate.py bash scripts/run_distribute.sh RANK_TABLE CONFIG [0,2] eval 2
--task mmlu --data_dir DIR``. Bad input: one ``error:`` line naming the file and line, exit 2.
Details: docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.errors import MsllmError, cli_main  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    from msllm.cli_args import split_overrides
    from msllm.config import load_config
    from msllm.eval.runner import TASKS, evaluate

    parser = argparse.ArgumentParser(prog="evaluate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run YAML (model shape, context, output_dir)")
    parser.add_argument("--load_checkpoint", help="msllm / MindFormers checkpoint or HF model directory")
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--data_dir", required=True, help="the task's data directory (ppl, mc: or a file)")
    parser.add_argument("--num_fewshot", type=int, help="examples in the prompt (default: the harness's)")
    parser.add_argument("--limit", type=int, help="first N questions (per subject for mmlu/ceval)")
    parser.add_argument("--batch_size", type=int, default=8, help="rows per forward pass (default 8)")
    parser.add_argument("--stride", type=int, help="ppl: window stride in tokens (default seq_length // 2)")
    parser.add_argument("--max_gen_toks", type=int, default=256, help="gsm8k: max new tokens (harness: 256)")
    parser.add_argument("--max_length", type=int,
                        help="context in tokens (lm-eval's flag); default: an HF directory's positions as lm-eval's "
                             "HFLM takes them (config.json), else the model's seq_length")
    parser.add_argument("--tokenizer", help="a SentencePiece tokenizer.model, a tokenizer.json or an HF model directory (default: the checkpoint's; the bundled LLaMA tokenizer only for a 32000-id model)")
    parser.add_argument("--adapter", help="a LoRA adapter checkpoint applied to the base")
    parser.add_argument("--reuse_prefix", action="store_true",
                        help="run shared few-shot prefixes once through the KV cache (memory-hungry on CPU)")
    parser.add_argument("--dense_head", action="store_true",
                        help="multiple choice: the output head at every position, as lm-eval's HFLM (same numbers, "
                             "more work; for like-for-like benchmarks)")
    parser.add_argument("--run_mode", default="eval", help="set by run_distribute.sh; must be eval")
    args, rest = parser.parse_known_args(argv)
    if args.run_mode != "eval":
        raise MsllmError(f"tools/evaluate.py runs run_mode eval, got --run_mode {args.run_mode}")
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1) or \
            (args.num_fewshot is not None and args.num_fewshot < 0):
        raise MsllmError("--batch_size and --limit must be >= 1, --num_fewshot >= 0")
    overrides = split_overrides(rest) + ["--run_mode=eval"]
    if args.load_checkpoint:
        overrides.append(f"--load_checkpoint={args.load_checkpoint}")
    cfg = load_config(args.config, overrides)
    evaluate(cfg, args.task, args.data_dir, args.num_fewshot, args.limit, args.batch_size, args.stride,
             args.tokenizer, args.adapter, args.max_gen_toks, reuse_prefix=args.reuse_prefix,
             max_length=args.max_length, dense_head=args.dense_head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
