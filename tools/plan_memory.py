"""Per-device training memory of a run config's layout, and layouts that fit.

Usage::

    python tools/plan_memory.py --config configs/llama/run_llama_70b.yaml [--device_memory 64GB] \
        [--recompute none|select|full] [--section.key=value ...]

Prints a table (GiB per device of each pipeline stage: weights, compute-dtype weight copies,
gradients, gradient accumulation, optimizer states, activations, head and loss, constants) and,
with ``--device_memory``, whether the worst stage fits and which dp/mp/pp/optimizer_shard/
recompute combinations of the same device count do. ``--device_memory`` defaults to the config's
``context.max_device_memory`` if set. Formulas: :mod:`msllm.parallel.planner`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.errors import cli_main  # noqa: E402


def parse_args(argv=None):
    """Command-line flags; unknown ``--section.key=value`` flags are config overrides."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", required=True, help="run YAML")
    p.add_argument("--device_memory", default=None, help="memory of one device, e.g. 64GB (binary units)")
    p.add_argument("--recompute", default=None, choices=["none", "select", "full"],
                   help="override recompute_config")
    p.add_argument("--suggest", type=int, default=10, help="how many fitting layouts to list (0 = none)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    return p.parse_known_args(argv)


@cli_main
def main(argv=None) -> int:
    args, rest = parse_args(argv)
    from msllm.cli_args import split_overrides
    from msllm.config import load_config
    from msllm.parallel.planner import format_plan, parse_memory, plan, suggest_layouts

    cfg = load_config(args.config, split_overrides(rest))
    mem_text = args.device_memory or cfg.context.max_device_memory
    mem = parse_memory(mem_text) if mem_text else None
    from msllm.lora.layout import lora_plan_inputs

    layouts, trainable = lora_plan_inputs(cfg)   # LoRA: the frozen base has no gradients or moments
    result = plan(cfg, mem, recompute=args.recompute, layouts=layouts, trainable=trainable)
    suggestions = suggest_layouts(cfg, mem, limit=args.suggest) if mem and args.suggest > 0 else None
    if args.json:
        print(json.dumps({"plan": result, "suggestions": suggestions}, indent=1))
    else:
        print(format_plan(result, suggestions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
