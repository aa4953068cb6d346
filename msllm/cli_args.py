"""The command line of ``run_msllm.py`` / ``python -m msllm`` / the ``msllm`` console script, parsed:
its own flags and the config overrides. Below every package but :mod:`msllm.errors`, so the
entry point (:mod:`msllm.cli`) and the launcher (:mod:`msllm.cluster.launch_plan`) parse a job's
arguments with the same code.

``--config CONFIG`` plus overrides in either form ``--section.key=value`` or
``--section.key value`` (values are parsed as YAML scalars).

MindFormers' ``run_mindformer.py`` flags work unchanged: ``--run_mode``, ``--load_checkpoint``,
``--resume_training``, ``--only_save_strategy``, ``--auto_trans_ckpt``,
``--src_strategy_path_or_dir``, ``--output_dir``, ``--seed`` set the same-named top-level keys;
``--train_dataset`` / ``--train_dataset_dir`` and ``--eval_dataset`` / ``--eval_dataset_dir`` set
``{train,eval}_dataset.dataset_dir``; ``--device_id`` / ``--device_target`` set ``context.*``;
``--predict_data`` is the text or file to run ``--run_mode predict`` on; ``--use_parallel`` must
agree with how the process was started (True under ``run_distribute.sh`` with several ranks,
False alone): a disagreement is an error, since msllm takes parallelism from the launcher.
``--template`` and ``--adapter`` (LoRA) apply to predict and eval. ``--sim_level 0|1
[--sim_rank_id R]`` compiles the job for Ascend with MindSpore's dry-run (:mod:`msllm.dryrun.driver`). ``--show`` prints the resolved
model shapes, parameter count and FLOPs per token and exits without building anything.
"""

from __future__ import annotations

import argparse

from msllm.errors import MsllmError

ALIASES = {"train_dataset_dir": "train_dataset.dataset_dir", "train_dataset": "train_dataset.dataset_dir",
           "eval_dataset_dir": "eval_dataset.dataset_dir", "eval_dataset": "eval_dataset.dataset_dir",
           "device_id": "context.device_id", "device_target": "context.device_target"}


def split_overrides(argv: list[str]) -> list[str]:
    """``["--a.b", "1", "--c=2"]`` -> ``["--a.b=1", "--c=2"]``; MsllmError on a stray value."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise MsllmError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value = arg[2:], argv[i + 1]
            i += 2
        else:
            raise MsllmError(f"override {arg!r} has no value: use {arg}=VALUE")
        out.append(f"--{ALIASES.get(key, key)}={value}")
    return out


def build_parser(config_required: bool = True) -> argparse.ArgumentParser:
    """``run_msllm.py``'s own flags (everything else is a config override)."""
    parser = argparse.ArgumentParser(prog="run_msllm.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=config_required, help="run YAML, e.g. configs/llama/run_llama_tiny.yaml")
    parser.add_argument("--show", action="store_true", help="print model shapes and sizes, then exit")
    parser.add_argument("--print_config", action="store_true", help="print the resolved config, then exit")
    parser.add_argument("--use_parallel", help="MindFormers' flag: must agree with the launch (see above)")
    parser.add_argument("--predict_data", help="predict: a prompt, or a .txt/.json/.jsonl file of prompts")
    parser.add_argument("--template", help="predict/chat: prompt template: vicuna_v1.1, alpaca, none, chat_template, chatml (default: the checkpoint's, else the tokenizer's chat template, else plain text)")
    parser.add_argument("--adapter", help="predict/eval: a LoRA adapter checkpoint applied to the base")
    sim = parser.add_argument_group("dry-run (msrun's names; docs/dryrun.md)")
    sim.add_argument("--sim_level", type=int, choices=(0, 1), help="compile the Ascend job with MindSpore's "
                     "simulation instead of running it: 0 compile, 1 compile + per-rank device memory")
    sim.add_argument("--sim_rank_id", help="the rank(s) to compile: R, R1,R2 or [START,END) (default: all)")
    sim.add_argument("--sim_jobs", type=int, help="ranks compiled at once (default: the CPU cores)")
    ev = parser.add_argument_group("eval (also tools/evaluate.py; without --task: perplexity over eval_dataset)")
    ev.add_argument("--task", help="ppl, mmlu, ceval, boolq, gsm8k or mc_jsonl (docs/evaluation.md)")
    ev.add_argument("--data_dir", help="the task's data: a directory of split files, or a file")
    ev.add_argument("--num_fewshot", type=int, help="few-shot examples per question (task default)")
    ev.add_argument("--limit", type=int, help="evaluate only the first N requests of each subject/task")
    ev.add_argument("--stride", type=int, help="ppl: sliding-window stride in tokens")
    ev.add_argument("--tokenizer", help="a SentencePiece tokenizer.model, a tokenizer.json or an HF model directory (default: the checkpoint's; the bundled LLaMA tokenizer only for a 32000-id model)")
    ev.add_argument("--max_gen_toks", type=int, help="gsm8k: most tokens generated per answer")
    ev.add_argument("--max_length", type=int, help="context in tokens (lm-eval's flag; default: an HF directory's "
                                                  "positions as lm-eval's HFLM takes them, else seq_length)")
    ev.add_argument("--reuse_prefix", action="store_true", help="reuse the few-shot prefix through the KV cache")
    ev.add_argument("--dense_head", action="store_true", help="multiple choice: the output head at every position, "
                    "as lm-eval's HFLM (same numbers, more work; for like-for-like benchmarks)")
    return parser


def parse_entry_args(argv: list[str], config_required: bool = True) -> tuple[argparse.Namespace, list[str]]:
    """``argv`` -> (``run_msllm.py``'s own flags, the config overrides as ``--a.b=value``); the
    launcher (:mod:`msllm.cluster.launch_plan`) parses a job's arguments with this too, so both agree
    on which arguments are config keys."""
    args, rest = build_parser(config_required).parse_known_args(argv)
    return args, split_overrides(rest)
