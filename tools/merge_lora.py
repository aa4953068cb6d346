#!/usr/bin/env python
"""Merge a LoRA adapter into its base model: W' = W + (lora_alpha / r) B A.

    python tools/merge_lora.py --base BASE --lora ADAPTER_CKPT --output MERGED.ckpt

BASE: the model the adapter was trained on (msllm or MindFormers-named .ckpt, or a Hugging Face
directory); its SHA-256 must equal the one the adapter's manifest records, else nothing is written.
ADAPTER_CKPT: an adapter checkpoint from LoRA training (output_dir/checkpoint/rank_0/*.ckpt) or
from the PEFT import. MERGED.ckpt gets a manifest (MERGED.ckpt.json) with the model config, so it
converts to Hugging Face with `tools/convert_weight.py --reversed --mindspore_ckpt_path MERGED.ckpt
--torch_ckpt_dir OUT`. Bad input: one `error:` line, exit 2, no output. See docs/lora.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.errors import cli_main  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="merge_lora.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="base model: .ckpt (msllm/MindFormers) or HF directory")
    p.add_argument("--lora", required=True, help="LoRA adapter checkpoint (.ckpt with its .ckpt.json manifest)")
    p.add_argument("--output", required=True, help="merged checkpoint to write (.ckpt)")
    p.add_argument("--no_progress", action="store_true", help="no tqdm progress bar")
    args = p.parse_args(argv)

    from msllm.lora.merge import merge_lora_checkpoint

    t0 = time.time()
    manifest = merge_lora_checkpoint(args.base, args.lora, args.output, progress=not args.no_progress)
    mf = manifest["merged_from"]
    print(f"merged {len(mf['modules'])} module(s) (rank {mf['lora_rank']}, scale {mf['scale']:g}) of {args.lora} "
          f"into {mf['base']['path']} -> {args.output} ({manifest['size'] / 1e6:.1f} MB, "
          f"{time.time() - t0:.1f} s); manifest {args.output}.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
