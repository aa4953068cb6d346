"""``run_msllm.py`` / ``python -m msllm`` / the ``msllm`` console script.

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
[--sim_rank_id R]`` compiles the job for Ascend with MindSpore's dry-run (:mod:`msllm.cluster.dryrun`). ``--show`` prints the resolved
model shapes, parameter count and FLOPs per token and exits without building anything.
"""

from __future__ import annotations

import argparse
import sys

from msllm.config import load_config, to_dict
from msllm.errors import MsllmError, cli_main

ALIASES = {"train_dataset_dir": "train_dataset.dataset_dir", "train_dataset": "train_dataset.dataset_dir",
           "eval_dataset_dir": "eval_dataset.dataset_dir", "eval_dataset": "eval_dataset.dataset_dir",
           "device_id": "context.device_id", "device_target": "context.device_target"}


def check_use_parallel(value: str | None) -> None:
    """``--use_parallel`` (MindFormers) must match the launch: True needs a multi-rank launcher
    (``run_distribute.sh``), False a single process. Raises MsllmError on a mismatch."""
    if value is None:
        return
    import yaml

    flag = yaml.safe_load(value)
    if not isinstance(flag, bool):
        raise MsllmError(f"--use_parallel {value!r}: expected True or False")
    from msllm.cluster.context import env_world_size

    world = env_world_size()
    if flag and world == 1:
        raise MsllmError("--use_parallel True, but this process was started alone: start parallel runs "
                         "with scripts/run_distribute.sh RANK_TABLE CONFIG [START,END] MODE RANK_SIZE "
                         "(msllm takes the ranks from the launcher)")
    if not flag and world > 1:
        raise MsllmError(f"--use_parallel False, but the launcher started {world} ranks: pass "
                         "--use_parallel True or launch a single process")


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


def show(cfg) -> None:
    """Print the model shapes and sizes of ``cfg``."""
    from msllm.models.llama.families import SWITCH_DEFAULTS

    mc = cfg.model_config
    print(f"model: {mc.model_type} (LLaMA family), {mc.num_layers} layers, hidden {mc.hidden_size}, heads "
          f"{mc.num_heads} ({mc.kv_heads} kv), head_dim {mc.head_dim}, ffn {mc.ffn_size}, vocab {mc.vocab_size}, "
          f"seq_length {mc.seq_length}, rope_theta {mc.rope_theta:g}")
    switches = {k: getattr(mc, k) for k in SWITCH_DEFAULTS if getattr(mc, k) != SWITCH_DEFAULTS[k]}
    if switches:
        print("family switches: " + ", ".join(f"{k}={v}" for k, v in switches.items()))
    print(f"parameters: {mc.num_params():,} ({mc.num_params() / 1e9:.3f}B)")
    if mc.moe_config is not None:
        m = mc.moe_config
        print(f"experts: {m.expert_num} per MoE layer, {m.num_experts_chosen} active; active parameters "
              f"{mc.active_params():,} ({mc.active_params() / 1e9:.3f}B)")
    print(f"train FLOPs per token (6N + 12LHDT, N the active matmul parameters): {mc.train_flops_per_token():.4g}")
    pc = cfg.parallel_config
    print(f"layout: data_parallel {pc.data_parallel} x model_parallel {pc.model_parallel} x "
          f"pipeline_stage {pc.pipeline_stage} = {pc.device_num} devices")


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
    ev.add_argument("--reuse_prefix", action="store_true", help="reuse the few-shot prefix through the KV cache")
    return parser


def parse_entry_args(argv: list[str], config_required: bool = True) -> tuple[argparse.Namespace, list[str]]:
    """``argv`` -> (``run_msllm.py``'s own flags, the config overrides as ``--a.b=value``); the
    launcher (:mod:`msllm.cluster.launch_plan`) parses a job's arguments with this too, so both agree
    on which arguments are config keys."""
    args, rest = build_parser(config_required).parse_known_args(argv)
    return args, split_overrides(rest)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_entry_args(argv)
    check_use_parallel(args.use_parallel)
    cfg = load_config(args.config, overrides)
    if args.show:
        show(cfg)
        return 0
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    if args.sim_level is not None:  # dry-run: compile for the named ranks, report, no training
        from msllm.cluster.dryrun import run_dryrun

        run_dryrun(args.config, overrides, args.sim_level, args.sim_rank_id, args.sim_jobs)
        return 0
    if cfg.only_save_strategy:  # offline: no runtime set-up, no weights; works for any layout on CPU
        from msllm.parallel.strategy import save_strategy_for_run

        from msllm.cluster.context import launcher_role

        extra = None
        if cfg.model_config.pet_config is not None:  # LoRA adapters follow their base layers' split
            from msllm.lora.layout import lora_param_layouts

            extra = lora_param_layouts(cfg.model_config, cfg.parallel_config)
        out = save_strategy_for_run(cfg, extra_layouts=extra)
        role, rank = launcher_role()  # under run_distribute.sh each rank writes only its own file
        print(f"strategy file of rank {rank} written to {out}" if role == "worker"
              else f"strategy files for {cfg.parallel_config.device_num} rank(s) written to {out}")
        return 0
    if cfg.run_mode == "predict":
        from msllm.generation.predict import run_predict

        run_predict(cfg, args.predict_data, template=args.template, adapter=args.adapter, tokenizer=args.tokenizer)
        return 0
    if cfg.run_mode == "eval":
        from msllm.eval.runner import run_eval

        run_eval(cfg, template=args.template, adapter=args.adapter, task=args.task, data=args.data_dir,
                 num_fewshot=args.num_fewshot, limit=args.limit, stride=args.stride, tokenizer=args.tokenizer,
                 max_gen_toks=args.max_gen_toks, reuse_prefix=args.reuse_prefix)
        return 0
    from msllm.training.trainer import train

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
