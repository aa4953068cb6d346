"""Fixtures of the evaluation tests: one random LLaMA as a transformers model and as the msllm
network converted from it (seed printed), the real tokenizer, and lm-eval's HFLM on it."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from evaltest_helpers import HF_CONFIG, MAX_LENGTH, TOKENIZER, hflm  # noqa: E402

SEED = 1234


@pytest.fixture(scope="session", params=["fast", "layout"])
def models(tmp_path_factory, request):
    """(transformers model, msllm network, LlamaConfig, HF directory, msllm checkpoint), the network
    on each model path: ``fast`` (the CPU fast path run_eval uses: msllm's kernels, compact views)
    and ``layout`` (the shapes the Ascend layouts are written for); every parity test runs on both."""
    import mindspore as ms

    from msllm.convert.hf import convert_hf_to_msllm
    from msllm.convert.verify import make_random_hf_model
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training import checkpoint as ckpt

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    d = tmp_path_factory.mktemp("eval_model")
    print(f"random LLaMA seed {SEED}: {HF_CONFIG}")
    hf = make_random_hf_model(str(d / "hf"), seed=SEED, **HF_CONFIG)
    path = str(d / "model.ckpt")
    cfg = dataclasses.replace(convert_hf_to_msllm(str(d / "hf"), path, progress=False).config, seq_length=MAX_LENGTH)
    net = LlamaForCausalLM(cfg, fast_paths=request.param == "fast")
    print("model path", request.param, net.kernels.describe())
    ckpt.load_into(net, ckpt.load_params(path), path)
    net.set_train(False)
    return hf, net, cfg, str(d / "hf"), path


@pytest.fixture(scope="session")
def lm(models):
    """lm-eval's reference: HFLM on the same transformers model, add_bos_token=True."""
    return hflm(models[0])


@pytest.fixture(scope="session")
def tokenizer():
    from msllm.data.tokenizer import LlamaTokenizer

    return LlamaTokenizer(TOKENIZER)
