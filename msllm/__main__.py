"""``python -m msllm --config CONFIG ...``: see :mod:`msllm.cli`."""

import sys

from msllm.cli import main

sys.exit(main())
