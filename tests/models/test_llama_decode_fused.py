"""The fused decode step in the model (``DecoderLayer.decode_fused``, msllm/kernels/csrc/decode_fused.cc)
and the whole stack in one operator (``LlamaModel.decode_layers``): generation's logits and caches are
the operator-by-operator path's bit for bit (float32, bfloat16 and int8 weights, per channel, per group,
with a layer kept in float32; batch 1 and a left-padded batch of 3),
and the family members the fused operators do not cover keep the old path (one condition:
``DecoderLayer.fused_decode_ok``): q/k norms, biases, Gemma's norm offset and GeGLU, experts, LoRA.
"""

import dataclasses

import numpy as np
import pytest

import mindspore as ms

from msllm.generation.decode import Generator
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.model import LlamaForCausalLM

SEED = 21


def tiny(**kw):
    base = dict(vocab_size=101, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=96,
                seq_length=64, initializer_range=0.2, tie_word_embeddings=True)
    base.update(kw)
    return LlamaConfig(**base)


BUFFER = 32          # cache slots of run()'s generations


def run(net, cfg, prompts, steps=5):
    """Prefill + ``steps`` greedy decode steps: every step's logits (steps + 1, B, V) and the
    caches afterwards as numpy (read back with ``asnumpy``, as the serving prefix cache does)."""
    gen = Generator(net, cfg)
    buffer, length = BUFFER, max(map(len, prompts))
    logits, caches, pads = gen.prefill(prompts, length, buffer, 0)
    out = [logits]
    for step in range(steps):
        logits, caches = gen.decode_step(logits.argmax(-1), length + step, pads, buffer, caches)
        out.append(logits)
    return np.stack(out), np.stack([c.asnumpy() for c in caches])


def trio(cfg, quant=None):
    """Three models with the same weights: the decode step's layers in one operator (the default),
    in two fused operators per layer, and operator by operator."""
    from msllm.models.llama.int8_model import quantize_model

    ms.set_seed(SEED)
    nets = [LlamaForCausalLM(cfg, fast_paths=True) for _ in range(3)]
    weights = {p.name: p.asnumpy() if p.dtype != ms.bfloat16 else p.astype(ms.float32).asnumpy()
               for p in nets[0].get_parameters()}
    for net in nets[1:]:
        for p in net.get_parameters():
            p.set_data(ms.Tensor(weights[p.name], p.dtype))
    if quant is not None:
        for net in nets:
            quantize_model(net, quant, net.kernels.cpu)
    for net in nets[1:]:
        net.model.decode_stack = None
    for layer in nets[2].model.layers:
        layer.decode_front = layer.decode_back = None
    return nets


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None), ("float32", (0, [])),
                                         ("float32", (32, [])), ("float32", (16, ["down_proj"]))],
                         ids=["f32", "bf16", "int8_channel", "int8_group", "int8_kept"])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_gives_the_unfused_logits_bit_for_bit(graph_mode, dtype, quant, rows):
    from msllm.models.llama.quantization import QuantizationConfig

    print("seed", SEED)
    qc = None
    if quant is not None:
        group, keep = quant
        qc = QuantizationConfig(quant_method="rtn", weight_quant_granularity="per_group" if group else "per_channel",
                                group_size=group, modules_to_not_convert=keep)
    cfg = tiny(param_init_type=dtype, quantization_config=qc)
    stack, fused, plain = trio(cfg, qc)
    assert stack.model.decode_layers_ok() and not fused.model.decode_layers_ok()
    assert all(layer.fused_decode_ok() for layer in fused.model.layers)
    assert not any(layer.fused_decode_ok() for layer in plain.model.layers)
    prompts = np.random.default_rng(SEED).integers(3, 101, (rows, 9)).tolist()
    if rows > 1:
        prompts[1] = prompts[1][:5]                                       # left padding in the batch
    want, want_caches = run(plain, cfg, prompts)
    got, got_caches = run(fused, cfg, prompts)
    one, one_caches = run(stack, cfg, prompts)
    assert np.abs(want).std() > 0.5                                       # logits carry signal
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(one, want)
    np.testing.assert_array_equal(one_caches, want_caches)
    # the fused front writes the decode steps' keys and values itself (no ScatterUpdate): the
    # caches, read back on the host, hold what MindSpore's ScatterUpdate wrote on the plain path
    slots = want_caches.reshape(want_caches.shape[0], BUFFER, rows, -1)  # (2L, S, B, K*D)
    length = max(map(len, prompts))
    assert (np.abs(slots[:, length:length + 5]).max(axis=-1) > 0).all()   # run()'s 5 decode slots are written
    np.testing.assert_array_equal(got_caches, want_caches)


@pytest.mark.parametrize("change", [dict(qk_norm=True), dict(qkv_has_bias=True), dict(rms_norm_offset=1.0),
                                    dict(hidden_act="gelu_pytorch_tanh")],
                         ids=["qk_norm", "bias", "norm_offset", "geglu"])
def test_family_members_without_a_fused_step_keep_the_old_path(change):
    net = LlamaForCausalLM(tiny(**change), fast_paths=True)
    assert not any(layer.fused_decode_ok() for layer in net.model.layers)


def test_experts_and_lora_keep_the_old_path():
    from msllm.config_lora import PetConfig
    from msllm.lora.apply import apply_lora
    from msllm.models.llama.config import MoeConfig

    moe = LlamaForCausalLM(tiny(moe_config=MoeConfig(expert_num=4, num_experts_chosen=2)), fast_paths=True)
    assert not any(layer.fused_decode_ok() for layer in moe.model.layers)
    assert not moe.model.decode_layers_ok()
    net = LlamaForCausalLM(tiny(), fast_paths=True)
    assert all(layer.fused_decode_ok() for layer in net.model.layers) and net.model.decode_layers_ok()
    apply_lora(net, PetConfig(lora_rank=4, lora_alpha=8.0, target_modules=".*q_proj"), dropout=0.0)
    assert not any(layer.fused_decode_ok() for layer in net.model.layers)
    assert not net.model.decode_layers_ok()
    # without msllm's kernels (cpu_kernels false) nothing is fused
    off = LlamaForCausalLM(dataclasses.replace(tiny(), cpu_kernels=False), fast_paths=True)
    assert not any(layer.fused_decode_ok() for layer in off.model.layers) and not off.model.decode_layers_ok()


def test_the_environment_switches_the_one_operator_stack_off(monkeypatch):
    monkeypatch.setenv("MSLLM_DECODE_STACK", "0")
    net = LlamaForCausalLM(tiny(), fast_paths=True)
    assert net.model.decode_stack is None and all(layer.fused_decode_ok() for layer in net.model.layers)
