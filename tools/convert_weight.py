#!/usr/bin/env python
"""Convert LLaMA weights between Hugging Face and msllm (MindSpore .ckpt); flags as MindFormers'.

HF -> msllm:
    python tools/convert_weight.py --torch_ckpt_dir HF_DIR --mindspore_ckpt_path OUT.ckpt
        [--dtype fp32|fp16|bf16] [--verify]
  HF_DIR holds config.json + *.safetensors or pytorch_model*.bin (sharded with an index json or
  not), or a Meta checkpoint (params.json + consolidated.NN.pth). Writes OUT.ckpt and its manifest
  OUT.ckpt.json and prints the model_config block for a run YAML.

msllm -> HF:
    python tools/convert_weight.py --reversed --mindspore_ckpt_path IN.ckpt --torch_ckpt_dir OUT_DIR
        [--config RUN_YAML] [--dtype ...] [--max_shard_size 2GB] [--verify]
  The model shape comes from IN.ckpt.json (written by the trainer), else from --config.

LoRA adapters <-> Hugging Face PEFT (adapter_config.json + adapter_model.safetensors):
    python tools/convert_weight.py --reversed --lora ADAPTER.ckpt --torch_ckpt_dir PEFT_DIR
    python tools/convert_weight.py --torch_ckpt_dir PEFT_DIR --lora ADAPTER.ckpt [--lora_base BASE]
  (docs/lora.md; --lora_base records the base the adapter belongs to, checked by SHA-256 later.)

--verify runs a real sentence through transformers and msllm and fails (exit 1, nothing published)
when max |logit diff| exceeds --tolerance or the greedy continuations differ. Bad input: one
``error:`` line naming the file/tensor/key, exit 2, no output. See docs/convert.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.errors import MsllmError, cli_main  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert_weight.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=["llama"], help="model family (MindFormers flag)")
    p.add_argument("--torch_ckpt_dir", required=True, help="HF checkpoint directory (input, or output with --reversed)")
    p.add_argument("--mindspore_ckpt_path", help="msllm .ckpt (output, or input with --reversed); not with --lora")
    p.add_argument("--lora", help="an msllm LoRA adapter checkpoint: with --reversed exported to a PEFT "
                   "directory (--torch_ckpt_dir), else written from the PEFT directory --torch_ckpt_dir")
    p.add_argument("--lora_base", help="--lora import: the base checkpoint/HF directory the adapter belongs to")
    p.add_argument("--reversed", action="store_true", help="convert msllm .ckpt -> HF directory")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16", "float32", "float16", "bfloat16"],
                   help="cast every tensor to this dtype (default: keep each tensor's dtype)")
    p.add_argument("--config", default=None, help="--reversed: run YAML giving model.model_config when "
                   "the checkpoint has no manifest")
    p.add_argument("--max_shard_size", default="2GB", help="--reversed: shard the safetensors above this "
                   "size (e.g. 2GB, 500MB, bytes); default 2GB")
    p.add_argument("--verify", action="store_true", help="check logits parity with transformers before publishing")
    p.add_argument("--tolerance", type=float, default=None, help="--verify: max |logit diff| (default 1e-4)")
    p.add_argument("--verify_tokens", type=int, default=5, help="--verify: greedy tokens to compare (default 5)")
    p.add_argument("--verify_mode", default="pynative", choices=["pynative", "graph"],
                   help="--verify: MindSpore execution mode of the msllm model (default pynative)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.model, tokenizer.json or HF directory: the "
                   "--verify prompt's tokenizer (default the bundled LLaMA examples/data/tokenizer.model); with "
                   "--reversed also copied into the HF directory, its bos/eos/pad ids written to config.json "
                   "(default there: the tokenizer the checkpoint's manifest records, when it still exists)")
    p.add_argument("--no_progress", action="store_true", help="no tqdm progress bar")
    return p


def make_verifier(args, hf_dir_of: str | None):
    """``before_publish(tmp, cfg)`` running the parity check; raises ParityError on failure."""
    from msllm.convert.hf import normalize_dtype
    from msllm.convert.verify import DEFAULT_TOLERANCE, ParityError, check_parity

    def verify(tmp: str, cfg) -> None:
        if args.reversed:
            ckpt, hf_dir = args.mindspore_ckpt_path, tmp
        else:
            ckpt, hf_dir = tmp, hf_dir_of
        report = check_parity(cfg, ckpt, hf_dir=hf_dir,
                              tolerance=args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE,
                              n_new=args.verify_tokens, mode=args.verify_mode, tokenizer_path=args.tokenizer,
                              round_to=normalize_dtype(args.dtype))
        for line in report.lines():
            print(line, flush=True)
        if not report.ok:
            raise ParityError(f"max |logit diff| {report.max_abs_diff:.3e} (tolerance {report.tolerance:g}), "
                              f"greedy {'agree' if report.hf_next == report.msllm_next else 'differ'}")
    return verify


def convert_lora(args) -> int:
    """``--lora``: msllm adapter <-> PEFT adapter directory (:mod:`msllm.lora.peft`)."""
    from msllm.lora.peft import export_peft, import_peft

    for flag in ("mindspore_ckpt_path", "dtype", "config", "verify"):
        if getattr(args, flag):
            raise MsllmError(f"--{flag} does not apply to --lora (adapters are converted as they are)")
    if args.reversed:
        cfg = export_peft(args.lora, args.torch_ckpt_dir)
        print(f"wrote {args.torch_ckpt_dir}: adapter_config.json (r {cfg['r']}, lora_alpha {cfg['lora_alpha']}, "
              f"target_modules {cfg['target_modules']}) + adapter_model.safetensors")
    else:
        m = import_peft(args.torch_ckpt_dir, args.lora, base=args.lora_base)
        print(f"wrote {args.lora} (+ manifest): {len(m['lora']['modules'])} modules, "
              f"rank {m['lora']['pet_config']['lora_rank']}")
    return 0


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.lora:
        return convert_lora(args)
    if not args.mindspore_ckpt_path:
        raise MsllmError("--mindspore_ckpt_path is required (or --lora for a LoRA adapter)")
    from msllm.convert import hf
    from msllm.convert.verify import ParityError

    if args.verify:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as exc:
            raise MsllmError(f"--verify needs torch and transformers ({exc}); pip install -e \".[convert]\"") from None
    t0 = time.perf_counter()
    try:
        if args.reversed:
            verify = make_verifier(args, None) if args.verify else None
            res = hf.convert_msllm_to_hf(args.mindspore_ckpt_path, args.torch_ckpt_dir, config_path=args.config,
                                         dtype=args.dtype, max_shard_size=args.max_shard_size,
                                         progress=not args.no_progress, before_publish=verify,
                                         tokenizer=args.tokenizer)
            for note in res.notes or ("no tokenizer written (pass --tokenizer to add one)",):
                print(note)
            print(f"wrote {res.output}: {res.tensors} tensors, {res.bytes / 1e6:.1f} MB "
                  f"({', '.join(res.dtypes)}) in {time.perf_counter() - t0:.1f}s")
        else:
            if args.config:
                raise MsllmError("--config is only used with --reversed (HF -> msllm reads config.json)")
            src_dir = args.torch_ckpt_dir
            has_hf_config = os.path.isfile(os.path.join(src_dir, "config.json"))
            verify = make_verifier(args, src_dir if has_hf_config else None) if args.verify else None
            res = hf.convert_hf_to_msllm(src_dir, args.mindspore_ckpt_path, dtype=args.dtype,
                                         progress=not args.no_progress, before_publish=verify)
            print(f"wrote {res.output} (+ manifest {res.output}.json): {res.tensors} tensors from "
                  f"{res.source_kind}, {res.bytes / 1e6:.1f} MB ({', '.join(res.dtypes)}) in "
                  f"{time.perf_counter() - t0:.1f}s")
            print("# model_config for a run YAML (set seq_length yourself):")
            print(hf.model_config_yaml(res.config), end="")
    except ParityError as exc:
        print(f"error: parity check failed, nothing written: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
