#!/usr/bin/env python
"""Train or fine-tune a LLaMA model: ``python run_msllm.py --config CONFIG --run_mode train``.

A thin front for :func:`msllm.cli.main` (same as ``python -m msllm`` and the ``msllm`` command).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from msllm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
