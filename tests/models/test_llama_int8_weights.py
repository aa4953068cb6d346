"""Weight-only int8 inference (``model.model_config.quantization_config``, msllm/models/llama/quantization.py):
every linear layer and the head hold int8 weights with float32 scales, the arithmetic stays float32.

Parity: quantizing replaces each weight matrix W by q * s (the RTN rule, checked in
tests/kernels/test_kernels_int8.py); nothing else changes. So the int8 model must give the logits of
a float32 model holding the dequantised weights q * s (float32 rounding only, 1e-5 relative), for a
prefill and decode steps, per channel and per group, with a tied head and with its own; and
``modules_to_not_convert`` keeps the named layers in float32 (then those take their float32 weights).
"""

import numpy as np
import pytest
from helpers import context_mode
from modeltest_helpers import greedy_logits as run

import mindspore as ms

from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.model import Linear, LlamaForCausalLM
from msllm.models.llama.int8_model import quantize_model
from msllm.models.llama.quantization import QuantizationConfig, dequantize, quantize_rows

SEED = 12


@pytest.fixture
def graph_mode():
    yield from context_mode("graph")


def tiny(tie, quant=None):
    return LlamaConfig(vocab_size=101, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2,
                       intermediate_size=96, seq_length=64, initializer_range=0.2, tie_word_embeddings=tie,
                       quantization_config=quant)


def linear_names(net):
    return [name for name, cell in net.cells_and_names() if isinstance(cell, Linear)]


@pytest.mark.parametrize("tie,group,keep", [(False, 0, []), (True, 0, []), (False, 32, []), (True, 16, ["lm_head"]),
                                            (False, 0, ["down_proj", "lm_head"])],
                         ids=["own_head", "tied_head", "per_group", "tied_kept", "kept_layers"])
def test_int8_model_gives_the_logits_of_float32_on_the_dequantised_weights(graph_mode, tie, group, keep):
    from msllm.kernels import available

    assert available(), "msllm's CPU kernels are built by the test setup (python -m msllm.kernels.build)"
    print("seed", SEED)
    ms.set_seed(SEED)
    qc = QuantizationConfig(quant_method="rtn", weight_quant_granularity="per_group" if group else "per_channel",
                            group_size=group, modules_to_not_convert=keep)
    ref_cfg, q_cfg = tiny(tie), tiny(tie, qc)
    ref = LlamaForCausalLM(ref_cfg, fast_paths=True)
    weights = {p.name: p.asnumpy() for p in ref.get_parameters()}
    ref_float = dict(weights)
    net = LlamaForCausalLM(q_cfg, fast_paths=True)
    for p in net.get_parameters():
        p.set_data(ms.Tensor(weights[p.name]))
    layers = linear_names(ref)
    info = quantize_model(net, qc, net.kernels.cpu)
    # the reference: every converted matrix replaced by its dequantised q * s in float32
    converted = [n for n in layers if not any(k in n for k in keep)]
    for name in converted:
        q, s, g = quantize_rows(weights[name + ".weight"], group)
        weights[name + ".weight"] = dequantize(q, s, g).astype(np.float32)
    head_int8 = tie and "lm_head" not in keep
    if head_int8:   # the tied head multiplies by the dequantised table; the lookup keeps the float table
        q, s, g = quantize_rows(weights["model.embed_tokens.embedding_table"], group)
        ref.lm_head = Linear(64, 101, ref_cfg, 0.2, ref.kernels.cpu)
        ref.lm_head.weight.set_data(ms.Tensor(dequantize(q, s, g).astype(np.float32)))
    for p in ref.get_parameters():
        if p.name in weights:
            p.set_data(ms.Tensor(weights[p.name]))
    assert info["layers"] == len(converted) + head_int8
    int8 = {p.name for p in net.get_parameters() if p.dtype == ms.int8}
    assert int8 == {n + ".weight" for n in converted} | ({"lm_head.weight"} if head_int8 else set())
    assert all(p.name + "_scale" in {x.name for x in net.get_parameters()} for p in net.get_parameters()
               if p.dtype == ms.int8)
    prompts = np.random.default_rng(SEED).integers(3, 101, (3, 9)).tolist()
    prompts[1] = prompts[1][:5]                                        # left padding in the batch
    want, want_tokens = run(ref, ref_cfg, prompts)
    got, got_tokens = run(net, q_cfg, prompts)
    assert np.abs(want).std() > 0.5                                    # logits carry signal
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got_tokens, want_tokens)
    # and the int8 weights are not the float32 ones (the comparison above is not float32 twice)
    first = converted[0] + ".weight"
    assert np.abs(weights[first] - ref_float[first]).max() > 1e-4


def test_int8_is_for_inference_on_the_cpu_kernels():
    from msllm.cluster.context import check_device_support
    from msllm.config import RunConfig

    cfg = RunConfig()
    cfg.model_config.quantization_config = QuantizationConfig(quant_method="rtn")
    check_device_support(cfg, inference=True)                         # predict / chat / serve / evaluate
    with pytest.raises(MsllmError, match="quantization_config .*inference only"):
        check_device_support(cfg)                                     # training
    cfg.context.device_target = "Ascend"
    with pytest.raises(MsllmError, match="quantization_config .*CPU kernels.*Golden-Stick"):
        check_device_support(cfg, inference=True)
    with pytest.raises(MsllmError, match="CPU kernels"):
        quantize_model(LlamaForCausalLM(tiny(False)), QuantizationConfig(quant_method="rtn"), None)


def test_param_init_type_int8_is_the_per_channel_shorthand():
    cfg = LlamaConfig(param_init_type="int8")
    assert cfg.param_init_type == "float32"
    assert cfg.quantization_config == QuantizationConfig(quant_method="rtn", weight_quant_granularity="per_channel")
    assert LlamaConfig(quantization_config={}).quantization_config is None        # MindFormers' "no quantization"
    for bad, match in [(dict(quant_method="gptq"), "quant_method='gptq'"),
                       (dict(group_size=64), "set quant_method"),
                       (dict(quant_method="rtn", weight_quant_granularity="per_group", group_size=100), "group_size=100"),
                       (dict(quant_method="rtn", group_size=64), "per_channel"),
                       (dict(quant_method="rtn", activation_dtype="int8"), "weights only"),
                       (dict(quant_method="rtn", weight_dtype="int4"), "weight_dtype")]:
        with pytest.raises(MsllmError, match=match):
            LlamaConfig(quantization_config=bad)
