"""Shared set-up of the generation tests: GRAPH_MODE (the mode generation compiles in), the real
LLaMA tokenizer, three real sentences of different lengths, random HF models built locally."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def generation_graph_mode(graph_mode):
    """Every generation test runs in GRAPH_MODE (``graph_mode``: tests/conftest.py)."""


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    from msllm.data.tokenizer import LlamaTokenizer

    return LlamaTokenizer(tokenizer_path)
