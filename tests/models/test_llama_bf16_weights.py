"""Inference with ``param_init_type: bfloat16`` on the CPU fast path: the weights are stored in
bfloat16 (half the bytes a decoded token reads) and the arithmetic stays float32.

Parity (stated in docs/serving.md): storing a weight in bfloat16 rounds it to 8 significant
bits (relative error at most 2^-9); nothing else changes. So a bf16-stored model must give the
logits of a float32 model holding the same rounded weights to float32 rounding (1e-5 relative
here, summation order only): exact for a checkpoint whose weights are bf16 values. What the
rounding itself does to a real float32 checkpoint is bounded in
``tests/generation/test_real_model_bf16_weights.py``.
"""

import numpy as np
import pytest
from helpers import context_mode
from modeltest_helpers import greedy_logits as run

import mindspore as ms

from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.model import LlamaForCausalLM

SEED = 11


@pytest.fixture
def graph_mode():
    yield from context_mode("graph")


def tiny(param_init_type, tie):
    return LlamaConfig(vocab_size=101, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2,
                       intermediate_size=96, seq_length=64, initializer_range=0.2,
                       param_init_type=param_init_type, tie_word_embeddings=tie)


def rounded_weights(net):
    """{name: float32 array rounded to bfloat16} of every parameter."""
    return {p.name: ms.Tensor(p.asnumpy(), ms.bfloat16).astype(ms.float32).asnumpy() for p in net.get_parameters()}


@pytest.mark.parametrize("tie", [False, True], ids=["own_head", "tied_embeddings"])
def test_bf16_weights_give_the_logits_of_float32_on_the_rounded_weights(graph_mode, tie):
    from msllm.kernels import available

    assert available(), "msllm's CPU kernels are built by the test setup (python -m msllm.kernels.build)"
    print("seed", SEED)
    ms.set_seed(SEED)
    ref_cfg, bf_cfg = tiny("float32", tie), tiny("bfloat16", tie)
    ref = LlamaForCausalLM(ref_cfg, fast_paths=True)
    weights = rounded_weights(ref)
    for p in ref.get_parameters():
        p.set_data(ms.Tensor(weights[p.name]))
    bf = LlamaForCausalLM(bf_cfg, fast_paths=True)
    for p in bf.get_parameters():
        p.set_data(ms.Tensor(weights[p.name], ms.bfloat16))
    assert {p.dtype for p in bf.get_parameters()} == {ms.bfloat16}
    prompts = np.random.default_rng(SEED).integers(3, 101, (3, 9)).tolist()
    prompts[1] = prompts[1][:5]                                        # left padding in the batch
    want, want_tokens = run(ref, ref_cfg, prompts)
    got, got_tokens = run(bf, bf_cfg, prompts)
    assert np.abs(want).std() > 0.5                                    # logits carry signal
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got_tokens, want_tokens)


def test_bf16_parameters_are_for_inference_only_on_cpu():
    from msllm.cluster.context import check_device_support
    from msllm.config import RunConfig

    cfg = RunConfig()
    cfg.model_config.param_init_type = "bfloat16"
    check_device_support(cfg, inference=True)                         # predict / chat / serve / evaluate
    with pytest.raises(MsllmError, match="param_init_type='bfloat16'.*use float32 on CPU"):
        check_device_support(cfg)                                     # training
    cfg.model_config.compute_dtype = "bfloat16"
    check_device_support(cfg, inference=True)                         # bf16 GEMM inputs, weights as stored
    with pytest.raises(MsllmError, match="float32 parameters for training"):
        check_device_support(cfg)


def test_bf16_weights_with_bf16_compute_give_the_logits_of_float32_weights_with_bf16_compute(graph_mode):
    """``compute_dtype: bfloat16`` with ``param_init_type: bfloat16`` (inference): the GEMMs take the
    stored bfloat16 weights as they are (``gemm_bf16_weights``; up to 8 rows the weight-streaming
    product on rounded x) and round the activations, so the logits are those of bf16 compute over
    float32 weights holding the same values, up to float32 summation order (1e-5 relative; a decode
    step's fused layers keep float32 activations in both). Against
    float32 compute on the same weights they differ (the activations' rounding, 2^-9 relative),
    within 3% of the logits' range on this random model, and the check can fail: at least one
    logit differs."""
    import dataclasses

    print("seed", SEED)
    ms.set_seed(SEED)
    f32 = LlamaForCausalLM(tiny("float32", True), fast_paths=True)
    weights = rounded_weights(f32)
    nets = {}
    for name, stored, compute in (("f32w_f32c", "float32", "float32"), ("f32w_bf16c", "float32", "bfloat16"),
                                  ("bf16w_bf16c", "bfloat16", "bfloat16")):
        cfg = dataclasses.replace(tiny(stored, True), compute_dtype=compute)
        net = LlamaForCausalLM(cfg, fast_paths=True)
        for p in net.get_parameters():
            p.set_data(ms.Tensor(weights[p.name], ms.bfloat16 if stored == "bfloat16" else ms.float32))
        nets[name] = (net, cfg)
    prompts = np.random.default_rng(SEED).integers(3, 101, (3, 9)).tolist()
    out = {k: run(net, cfg, prompts, steps=3) for k, (net, cfg) in nets.items()}
    same = out["f32w_bf16c"][0]
    np.testing.assert_allclose(out["bf16w_bf16c"][0], same, rtol=0, atol=1e-5 * np.abs(same).max())
    want, got = out["f32w_f32c"][0], out["bf16w_bf16c"][0]
    assert np.abs(want).std() > 0.5
    diff = np.abs(got[0] - want[0])                                    # the prefill's logits
    assert 0 < diff.max() <= 0.03 * (want.max() - want.min()), diff.max()
