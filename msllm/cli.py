"""``run_msllm.py`` / ``python -m msllm`` / the ``msllm`` console script: parse the command line
(:mod:`msllm.cli_args`, whose docstring lists the flags), load the config, run the mode (train,
finetune, predict, eval, ``--only_save_strategy``, ``--show``). ``--use_parallel`` must agree
with how the process was started: msllm takes parallelism from the launcher.
"""

from __future__ import annotations

import sys

from msllm.cli_args import parse_entry_args
from msllm.config import load_config, to_dict
from msllm.errors import MsllmError, cli_main

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


@cli_main
def main(argv: list[str] | None = None) -> int:
    """``run_msllm.py``: the run mode of the config (train, finetune, predict, eval, a dry-run, the
    strategy files); 0 on success, after which a process started by the launcher marks its work done
    (:func:`msllm.cluster.rank_done.mark_done`)."""
    code = _run(argv)
    if code == 0:
        from msllm.cluster.rank_done import mark_done

        mark_done()
    return code


def _run(argv: list[str] | None) -> int:
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
        from msllm.dryrun.driver import run_dryrun

        run_dryrun(args.config, overrides, args.sim_level, args.sim_rank_id, args.sim_jobs)
        return 0
    if cfg.only_save_strategy:  # offline: no runtime set-up, no weights; works for any layout on CPU
        from msllm.parallel.strategy import save_strategy_for_run

        from msllm.cluster.context import launcher_role

        extra = None
        if cfg.pet_config is not None:  # LoRA adapters follow their base layers' split
            from msllm.lora.layout import lora_param_layouts

            extra = lora_param_layouts(cfg.model_config, cfg.pet_config, cfg.parallel_config)
        role, rank = launcher_role()  # under run_distribute.sh each rank writes only its own file
        if role == "scheduler":      # a CPU cluster's scheduler process has no rank: nothing to write
            return 0
        out = save_strategy_for_run(cfg, rank=rank, extra_layouts=extra)
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
                 max_gen_toks=args.max_gen_toks, reuse_prefix=args.reuse_prefix, max_length=args.max_length,
                 dense_head=args.dense_head)
        return 0
    from msllm.training.trainer import train

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
