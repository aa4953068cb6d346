"""Paths of the real bundled data and a CLI runner for the data-pipeline tests.

(A uniquely named module rather than ``conftest`` so that ``import`` never picks up another test
folder's conftest.)
"""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import DATA, REPO, TOKENIZER  # noqa: F401  (re-exported to the data tests)

ALPACA = os.path.join(DATA, "alpaca_en_demo.json")
WIKI = os.path.join(DATA, "wiki_demo.txt")
BAD_INPUTS = os.path.join(REPO, "tests", "bad_inputs")


def run_cli(script: str, *args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``data_preprocess/<script>`` with the current interpreter; capture text output."""
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "data_preprocess", script), *args],
        capture_output=True, text=True, cwd=cwd, timeout=300,
    )
