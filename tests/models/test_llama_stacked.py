"""Decoder-layer weights stacked over the layers (msllm/models/llama/stacked.py): generation's logits and
caches equal those of the same model with each layer's own weights bit for bit (float32, bfloat16 with float32
or bfloat16 compute, int8 per channel and per group; batch 1 and a left-padded batch of 3), the model holds one copy of the weights
afterwards, a model whose layers differ (int8 with a projection kept in float32 in one layer) stays as it
was, and the slice products refuse a layer outside the stack.
"""

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from msllm.models.llama.model import LlamaForCausalLM
from msllm.models.llama.stacked import can_stack, stack_decoder_weights
from tests.models.test_llama_decode_fused import run, tiny

SEED = 23


def pair(cfg, quant=None):
    """Two models with the same weights (seed SEED), the second's layers stacked."""
    from msllm.models.llama.int8_model import quantize_model

    ms.set_seed(SEED)
    nets = [LlamaForCausalLM(cfg, fast_paths=True) for _ in range(2)]
    weights = {p.name: p.asnumpy() if p.dtype != ms.bfloat16 else p.astype(ms.float32).asnumpy()
               for p in nets[0].get_parameters()}
    for p in nets[1].get_parameters():
        p.set_data(Tensor(weights[p.name], p.dtype))
    if quant is not None:
        for net in nets:
            quantize_model(net, quant, net.kernels.cpu)
    assert stack_decoder_weights(nets[1].model, nets[1].kernels.cpu)
    return nets


def unique_bytes(net):
    seen = {}
    for p in net.get_parameters():
        seen[id(p)] = p.size * np.dtype(ms.dtype_to_nptype(p.dtype) if p.dtype != ms.bfloat16 else np.uint16).itemsize
    return sum(seen.values())


@pytest.mark.parametrize("dtype,group,rows,compute", [("float32", None, 3, "float32"), ("bfloat16", None, 1, "float32"),
                                                      ("bfloat16", None, 3, "bfloat16"), ("float32", 0, 1, "float32"),
                                                      ("float32", 32, 3, "float32")],
                         ids=["f32_3rows", "bf16_1row", "bf16_compute_3rows", "int8_channel_1row", "int8_group_3rows"])
def test_stacked_weights_give_the_layers_logits_and_caches_bit_for_bit(graph_mode, dtype, group, rows, compute):
    from msllm.models.llama.quantization import QuantizationConfig

    print("seed", SEED)
    qc = None
    if group is not None:
        qc = QuantizationConfig(quant_method="rtn", weight_quant_granularity="per_group" if group else "per_channel",
                                group_size=group)
    # compute bfloat16: the prefill's products round x to bfloat16 (linear_bf16math / linear_layer_bf16math), so a
    # stacked model that fell back to float32 arithmetic in its layers gives other logits
    cfg = tiny(param_init_type=dtype, compute_dtype=compute, quantization_config=qc, num_layers=3)
    plain, stacked = pair(cfg, qc)
    assert stacked.model.stacked_norms is not None and plain.model.stacked_norms is None
    q = [layer.self_attn.q_proj for layer in stacked.model.layers]
    assert all(lin.weight is q[0].weight for lin in q) and tuple(q[0].weight.shape) == (3, 64, 64)
    assert not any(layer.fused_decode_ok() for layer in stacked.model.layers) and stacked.model.decode_layers_ok()
    prompts = np.random.default_rng(SEED).integers(3, 101, (rows, 9)).tolist()
    if rows > 1:
        prompts[1] = prompts[1][:5]                                       # left padding in the batch
    want, want_caches = run(plain, cfg, prompts)
    got, got_caches = run(stacked, cfg, prompts)
    assert np.abs(want).std() > 0.5                                       # logits carry signal
    np.testing.assert_array_equal(got, want)                              # prefill (slices) and decode (stack)
    np.testing.assert_array_equal(got_caches, want_caches)


def test_the_stacked_model_holds_one_copy_of_the_weights():
    cfg = tiny(num_layers=3)
    plain, stacked = pair(cfg)
    norms = 2 * cfg.num_layers * cfg.hidden_size * 4                       # the norms' (L, C) copies
    assert unique_bytes(stacked) == unique_bytes(plain) + norms
    names = {p.name for p in stacked.get_parameters()}
    assert "model.layers.stacked.gate_proj.weight" in names
    assert not any(n.startswith("model.layers.0.mlp.gate_proj") for n in names)
    assert not stack_decoder_weights(stacked.model, stacked.kernels.cpu)   # once only


def test_layers_that_differ_and_the_switch_keep_each_layers_weights(monkeypatch):
    from msllm.models.llama.int8_model import quantize_model
    from msllm.models.llama.quantization import QuantizationConfig

    cfg = tiny(num_layers=2)
    net = LlamaForCausalLM(cfg, fast_paths=True)
    qc = QuantizationConfig(quant_method="rtn", weight_quant_granularity="per_channel",
                            modules_to_not_convert=["layers.1.mlp.down_proj"])
    quantize_model(net, qc, net.kernels.cpu)
    assert net.model.layers[0].mlp.down_proj.int8 and not net.model.layers[1].mlp.down_proj.int8
    assert can_stack(net.model) and not stack_decoder_weights(net.model, net.kernels.cpu)
    assert net.model.stacked_norms is None and net.model.layers[0].mlp.down_proj.layer_index is None
    monkeypatch.setenv("MSLLM_STACK_WEIGHTS", "0")
    other = LlamaForCausalLM(cfg, fast_paths=True)
    assert not can_stack(other.model) and not stack_decoder_weights(other.model, other.kernels.cpu)


def test_the_slice_products_equal_numpy_and_refuse_a_layer_outside_the_stack():
    from msllm.kernels.select import choose

    kern = choose(tiny(), True, "CPU").cpu
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    x = rng.standard_normal((2, 40), np.float32)
    w = rng.standard_normal((3, 24, 40), np.float32)
    y = kern.linear_layer(Tensor(x), Tensor(w), Tensor(np.array([2], np.int32))).asnumpy()
    np.testing.assert_allclose(y, x @ w[2].T, rtol=1e-5, atol=1e-5)
    q = rng.integers(-127, 128, (3, 24, 40)).astype(np.int8)
    s = rng.uniform(0.01, 0.02, (3, 24, 2)).astype(np.float32)             # two groups of 20 inputs
    y8 = kern.linear_int8_layer(Tensor(x), Tensor(q), Tensor(s), kern.group_tensor(20),
                                Tensor(np.array([1], np.int32))).asnumpy()
    deq = q[1].astype(np.float32) * np.repeat(s[1], 20, axis=1)
    np.testing.assert_allclose(y8, x @ deq.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):
        kern.linear_layer(Tensor(x), Tensor(w), Tensor(np.array([3], np.int32))).asnumpy()
    with pytest.raises(RuntimeError):
        kern.linear_int8_layer(Tensor(x), Tensor(q), Tensor(s), kern.group_tensor(20),
                               Tensor(np.array([-1], np.int32))).asnumpy()
