"""The LoRA cell and apply_lora in PYNATIVE mode: the cell computes x W^T + (alpha/r) (x A^T) B^T
(numpy float64 reference), the base is frozen and untouched, adapters carry PEFT-mappable names,
and at initialisation (B = 0) the adapted model's logits equal the base model's bit for bit."""

import numpy as np
import pytest

from lora_helpers import SEED, build, logits, random_adapters, save_base, set_mode, tiny_config
from msllm.errors import MsllmError
from msllm.lora.apply import adapter_param_names, apply_lora, frozen_param_names
from msllm.lora.layer import LoRALinear, init_a
from msllm.config_lora import PetConfig


@pytest.fixture(autouse=True)
def pynative():
    set_mode("pynative")


def test_cell_matches_the_lora_formula():
    import mindspore as ms

    from msllm.models.llama.model import Linear

    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    cfg = tiny_config()
    base = Linear(48, 40, cfg, 0.02)
    w = rng.standard_normal((40, 48)).astype(np.float32)
    base.weight.set_data(ms.Tensor(w))
    a = rng.standard_normal((6, 48)).astype(np.float32)
    b = rng.standard_normal((40, 6)).astype(np.float32)
    cell = LoRALinear(base, rank=6, alpha=9.0, dropout=0.0, a=a, b=b)
    x = rng.standard_normal((10, 48)).astype(np.float32)
    got = cell(ms.Tensor(x)).asnumpy()
    x64 = x.astype(np.float64)
    ref = x64 @ w.T + (9.0 / 6.0) * (x64 @ a.T) @ b.T.astype(np.float64)
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref)), np.max(np.abs(got - ref))
    assert cell.weight is base.weight and not cell.weight.requires_grad


def test_kaiming_uniform_init_is_peft_default_and_reproducible():
    import math

    import torch

    a = init_a((8, 400), "kaiming_uniform", 0, "x.lora_A.weight")
    bound = 1 / math.sqrt(400)
    assert a.dtype == np.float32 and np.abs(a).max() <= bound and np.abs(a).max() > 0.95 * bound
    # torch's kaiming_uniform_(a=sqrt(5)) (PEFT's init) has the same bound
    t = torch.empty(8, 400)
    torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    assert abs(t.abs().max().item() - bound) < 0.05 * bound
    assert np.array_equal(a, init_a((8, 400), "kaiming_uniform", 0, "x.lora_A.weight"))
    assert not np.array_equal(a, init_a((8, 400), "kaiming_uniform", 0, "y.lora_A.weight"))
    assert not np.array_equal(a, init_a((8, 400), "kaiming_uniform", 1, "x.lora_A.weight"))
    assert abs(init_a((64, 400), "gaussian", 0, "x").std() - 1 / 64) < 0.1 / 64
    assert abs(init_a((64, 400), "normal", 0, "x").std() - 0.01) < 0.001


def test_at_initialisation_logits_equal_the_base_exactly():
    cfg = tiny_config()
    net = build(cfg)
    ids = np.random.default_rng(SEED).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    before = logits(net, ids)
    weights = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    info = apply_lora(net, PetConfig(lora_rank=8, lora_alpha=16, target_modules=".*"), seed=SEED)
    assert len(info.modules) == 2 * 7 + 1  # every linear layer and the head
    after = logits(net, ids)
    assert np.array_equal(before, after)  # B = 0: bit for bit
    for p in net.get_parameters():
        if p.name in weights:
            assert np.array_equal(p.asnumpy(), weights[p.name]), p.name


def test_apply_lora_freezes_the_base_and_names_adapters_like_peft():
    cfg = tiny_config()
    net = build(cfg)
    names_before = [p.name for p in net.get_parameters()]
    info = apply_lora(net, PetConfig(lora_rank=4, lora_alpha=8, target_modules=".*wq|.*wv"))
    trainable = [p.name for p in net.trainable_params()]
    assert trainable == adapter_param_names(net) == info.adapter_params
    assert trainable == [f"model.layers.{i}.self_attn.{m}_proj.{w}.weight" for i in range(2) for m in "qv"
                         for w in ("lora_A", "lora_B")]
    assert frozen_param_names(net) == names_before  # base names unchanged, all frozen
    assert all(not p.requires_grad for p in net.get_parameters() if p.name in names_before)
    shapes = {p.name: p.shape for p in net.get_parameters()}
    assert shapes["model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, 64)
    assert shapes["model.layers.0.self_attn.v_proj.lora_B.weight"] == (32, 4)
    assert info.trainable == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    assert info.total == cfg.num_params() + info.trainable
    line = info.log_line()
    assert "trainable of" in line and "model.layers.{0-1}.self_attn.q_proj" in line
    with pytest.raises(MsllmError, match="already has LoRA"):
        apply_lora(net, PetConfig())


def test_nonzero_adapter_changes_logits_and_dropout_is_off_in_eval():
    cfg = tiny_config()
    net = build(cfg)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 16)).astype(np.int32)
    base = logits(net, ids)
    apply_lora(net, PetConfig(lora_rank=4, lora_dropout=0.5, target_modules=".*"))
    random_adapters(net)
    a, b = logits(net, ids), logits(net, ids)
    assert np.array_equal(a, b)  # eval: dropout off, deterministic
    assert np.max(np.abs(a - base)) > 1e-2


def test_load_base_into_works_before_and_after_apply(tmp_path):
    from msllm.convert.starting import base_identity, load_base_into

    cfg = tiny_config()
    ref = build(cfg, seed=5)
    path = save_base(ref, str(tmp_path / "base.ckpt"))
    ids = np.arange(12, dtype=np.int32).reshape(1, 12)
    want = logits(ref, ids)
    for order in ("before", "after"):
        net = build(cfg, seed=99)
        if order == "after":
            apply_lora(net, PetConfig(target_modules=".*"))
        ident = load_base_into(net, path)
        if order == "before":
            apply_lora(net, PetConfig(target_modules=".*"))
        assert np.array_equal(logits(net, ids), want), order
    assert ident == base_identity(path) and ident["kind"] == "checkpoint" and len(ident["sha256"]) == 64


def test_dropout_acts_on_the_adapter_input_in_training_only():
    import mindspore as ms

    from msllm.models.llama.model import Linear

    ms.set_seed(SEED)
    rng = np.random.default_rng(SEED)
    base = Linear(32, 16, tiny_config(), 0.02)
    a = rng.standard_normal((4, 32)).astype(np.float32)
    b = rng.standard_normal((16, 4)).astype(np.float32)
    x = ms.Tensor(rng.standard_normal((64, 32)).astype(np.float32))
    cell = LoRALinear(base, 4, 4.0, 0.5, a, b)
    plain = LoRALinear(Linear(32, 16, tiny_config(), 0.02), 4, 4.0, 0.0, a, b)
    plain.weight.set_data(base.weight.value())
    cell.set_train(False)
    plain.set_train(True)
    assert np.array_equal(cell(x).asnumpy(), plain(x).asnumpy())  # eval: no dropout
    cell.set_train(True)
    y1, y2 = cell(x).asnumpy(), cell(x).asnumpy()
    assert not np.array_equal(y1, y2)  # fresh masks per call
    # dropout touches the adapter path only: what differs from x W^T lies in the span of B's columns
    update = y1 - x.asnumpy() @ base.weight.asnumpy().T                        # (N, out)
    residual = update - (update @ np.linalg.pinv(b).T) @ b.T                   # remove the span of B
    assert np.abs(update).max() > 0.1 and np.abs(residual).max() < 1e-4


@pytest.mark.parametrize("fast_paths", [False, True], ids=["composed", "cpu_kernels"])
def test_generation_runs_the_output_heads_adapter(fast_paths):
    """A LoRA on ``lm_head`` (untied head) acts in generation as in the full forward pass (which
    tests/lora/test_lora_peft.py checks against PEFT): the generator's head call with a row count
    known at compile time goes through the adapter, not around it."""
    from msllm.generation.decode import Generator

    cfg = tiny_config(tie_word_embeddings=False)
    net = build(cfg, fast_paths=fast_paths)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    base = logits(net, ids)[:, -1]
    apply_lora(net, PetConfig(lora_rank=4, target_modules="lm_head"), dropout=0.0)
    random_adapters(net)
    want = logits(net, ids)[:, -1]
    got, _, _ = Generator(net, cfg).prefill(ids.tolist(), 12, 16, 0)
    assert np.max(np.abs(want - base)) > 1e-2                         # the adapter changes the head
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
