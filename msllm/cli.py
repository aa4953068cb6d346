"""``run_msllm.py`` / ``python -m msllm`` / the ``msllm`` console script.

``--config CONFIG`` plus overrides in either form ``--section.key=value`` or
``--section.key value`` (values are parsed as YAML scalars). MindFormers' own flags are overrides
of the same-named top-level keys (``--run_mode``, ``--load_checkpoint``, ``--resume_training``,
``--only_save_strategy``, ``--auto_trans_ckpt``, ``--output_dir``, ``--seed``), and
``--train_dataset_dir`` sets ``train_dataset.dataset_dir``. ``--show`` prints the resolved model
shapes, parameter count and FLOPs per token and exits without building anything.
"""

from __future__ import annotations

import argparse
import sys

from msllm.config import load_config, to_dict
from msllm.errors import MsllmError, cli_main

ALIASES = {"train_dataset_dir": "train_dataset.dataset_dir"}


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
    mc = cfg.model_config
    print(f"model: LLaMA, {mc.num_layers} layers, hidden {mc.hidden_size}, heads {mc.num_heads} "
          f"({mc.kv_heads} kv), head_dim {mc.head_dim}, ffn {mc.ffn_size}, vocab {mc.vocab_size}, "
          f"seq_length {mc.seq_length}, rope_theta {mc.rope_theta:g}")
    print(f"parameters: {mc.num_params():,} ({mc.num_params() / 1e9:.3f}B)")
    print(f"train FLOPs per token (6N + 12LHDT): {mc.train_flops_per_token():.4g}")
    pc = cfg.parallel_config
    print(f"layout: data_parallel {pc.data_parallel} x model_parallel {pc.model_parallel} x "
          f"pipeline_stage {pc.pipeline_stage} = {pc.device_num} devices")


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run_msllm.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run YAML, e.g. configs/llama/run_llama_tiny.yaml")
    parser.add_argument("--show", action="store_true", help="print model shapes and sizes, then exit")
    parser.add_argument("--print_config", action="store_true", help="print the resolved config, then exit")
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(args.config, split_overrides(rest))
    if args.show:
        show(cfg)
        return 0
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    if cfg.only_save_strategy:  # offline: no runtime set-up, no weights; works for any layout on CPU
        from msllm.parallel.strategy import save_strategy_for_run

        out = save_strategy_for_run(cfg)
        print(f"strategy files for {cfg.parallel_config.device_num} rank(s) written to {out}")
        return 0
    from msllm.training.trainer import train

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
