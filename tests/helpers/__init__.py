"""Test helpers shared by several test folders: paths of the repository and its bundled real data.

Importable as ``helpers`` (``tests/conftest.py`` puts ``tests/`` on ``sys.path``); a folder's own
helpers stay in its uniquely named module (``datatest_helpers``, ``evaltest_helpers``, ...).
:mod:`helpers.distributed` runs ``scripts/run_distribute.sh`` on 2 local ranks.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DATA = os.path.join(REPO, "examples", "data")          # the bundled real samples
TOKENIZER = os.path.join(DATA, "tokenizer.model")      # the real LLaMA SentencePiece model
TINY_YAML = os.path.join(REPO, "configs", "llama", "run_llama_tiny.yaml")


def context_mode(name: str):
    """Generator for fixtures: MindSpore on CPU in ``name`` ("graph" or "pynative") mode until the
    fixture ends, then the previous mode again."""
    import mindspore as ms

    previous = ms.get_context("mode")
    try:
        ms.set_device("CPU")
    except RuntimeError:
        # MindSpore refuses set_device once a kernel has run in this process (a module's earlier tests in
        # PyNative); the runtime it initialised is this CPU's, which is what the fixture asks for
        if ms.get_context("device_target") != "CPU":
            raise
    ms.set_context(mode=ms.GRAPH_MODE if name == "graph" else ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=previous)
