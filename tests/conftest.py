"""Shared test set-up: quiet MindSpore's C++ logging, paths to the bundled real data."""

import os

import pytest

os.environ.setdefault("GLOG_v", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "data")


@pytest.fixture(scope="session")
def repo_root() -> str:
    return ROOT


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    return os.path.join(EXAMPLES, "tokenizer.model")


@pytest.fixture(scope="session")
def alpaca_path() -> str:
    return os.path.join(EXAMPLES, "alpaca_en_demo.json")


@pytest.fixture(scope="session")
def alpaca_mindrecord(tmp_path_factory) -> str:
    """The bundled real Alpaca records, converted and tokenized at seq_length 64 (999 samples)."""
    from msllm.data.conversation import convert_alpaca_file
    from msllm.data.preprocess import preprocess_to_mindrecord

    d = tmp_path_factory.mktemp("alpaca64")
    conv = str(d / "conv.json")
    convert_alpaca_file(os.path.join(EXAMPLES, "alpaca_en_demo.json"), conv)
    out = str(d / "alpaca_64.mindrecord")
    preprocess_to_mindrecord(conv, "qa", os.path.join(EXAMPLES, "tokenizer.model"), 64, out, progress=False)
    return out
