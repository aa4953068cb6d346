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
