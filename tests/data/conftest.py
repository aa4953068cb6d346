"""Shared fixtures for the data-pipeline tests: real bundled data and tokenizer."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from datatest_helpers import ALPACA, TOKENIZER  # noqa: E402


@pytest.fixture(scope="session")
def alpaca_records() -> list[dict]:
    """The 999 real Alpaca records."""
    with open(ALPACA, encoding="utf-8") as fh:
        return json.load(fh)


@pytest.fixture(scope="session")
def tokenizer():
    """The real LLaMA tokenizer."""
    from msllm.data.tokenizer import LlamaTokenizer

    return LlamaTokenizer(TOKENIZER)


@pytest.fixture(scope="session")
def conversation_file(tmp_path_factory) -> str:
    """The full bundled Alpaca converted to conversation JSON (in-process converter)."""
    from msllm.data.conversation import convert_alpaca_file

    out = str(tmp_path_factory.mktemp("conv") / "alpaca-conversation.json")
    convert_alpaca_file(ALPACA, out)
    return out
