"""LoRA against Hugging Face PEFT (the independent reference): the same adapter weights give the
same logits (1e-4); one training step's loss and adapter gradients on a real Alpaca batch equal
PEFT's (relative 1e-5); an msllm adapter exported to a PEFT directory loads with
``PeftModel.from_pretrained`` and gives msllm's logits; a PEFT adapter imported into msllm gives
PEFT's logits; adapters PEFT made for other architectures or non-vanilla LoRA are refused."""

import json
import os

import numpy as np
import pytest

from lora_helpers import SEED, alpaca_rows, logits, random_adapters, set_mode
from msllm.errors import MsllmError
from msllm.config_lora import PetConfig

torch = pytest.importorskip("torch")  # test reference only; installed in CI (setup.py extras "dev")
peft = pytest.importorskip("peft")

HF_CFG = dict(vocab_size=32000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
T = 64


@pytest.fixture(autouse=True)
def pynative():
    set_mode("pynative")  # before any kernel runs: MindSpore fixes the device at the first one


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A seeded random HF LLaMA (GQA) directory and its msllm conversion."""
    from msllm.convert.hf import convert_hf_to_msllm
    from msllm.convert.verify import make_random_hf_model

    d = tmp_path_factory.mktemp("peft_base")
    make_random_hf_model(str(d / "hf"), seed=SEED, **HF_CFG)
    res = convert_hf_to_msllm(str(d / "hf"), str(d / "base.ckpt"), progress=False)
    return {"hf": str(d / "hf"), "ckpt": str(d / "base.ckpt"), "config": res.config, "dir": d}


def hf_model(base):
    from msllm.convert.verify import hf_model as load

    return load(base["hf"])


FAST = {"on": False}


@pytest.fixture(params=["layout", "fast"], autouse=True)
def model_path(request):
    """Every test on both model paths: the CPU fast path (msllm's kernels, what LoRA training and
    inference run on CPU) and the layout path (the shapes of the Ascend layouts)."""
    FAST["on"] = request.param == "fast"
    print("model path", request.param)
    yield request.param


def msllm_net(base):
    from msllm.convert.verify import msllm_network

    # PYNATIVE, weights as the trainer loads them, on the model path of this test's parameter
    net = msllm_network(base["config"], base["ckpt"], T, fast_paths=FAST["on"])
    set_mode("pynative")
    return net


def peft_state(adapters: dict) -> dict:
    """msllm adapter names -> the PEFT model's parameter names (adapter ``default``)."""
    return {"base_model.model." + n.replace(".weight", ".default.weight"): torch.from_numpy(v)
            for n, v in adapters.items()}


def peft_model(base, r, alpha, targets, adapters=None, **kw):
    model = peft.get_peft_model(hf_model(base), peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                                 lora_dropout=0.0, **kw))
    if adapters is not None:
        missing, unexpected = model.load_state_dict(peft_state(adapters), strict=False)
        assert not unexpected and not [m for m in missing if "lora_" in m]
    return model.eval()


def torch_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids).long()).logits.numpy()


def test_same_adapter_weights_give_peft_logits(base):
    from msllm.lora.apply import apply_lora

    net = msllm_net(base)
    apply_lora(net, PetConfig(lora_rank=4, lora_alpha=8, target_modules=".*"))
    adapters = random_adapters(net, seed=SEED, scale=0.05)
    pm = peft_model(base, 4, 8, ALL, adapters)
    ids = np.random.default_rng(SEED).integers(0, 32000, (2, T)).astype(np.int32)
    ref, got = torch_logits(pm, ids), logits(net, ids)
    with pm.disable_adapter():
        plain = torch_logits(pm, ids)
    print("seed", SEED, "max |diff|", np.abs(ref - got).max(), "adapter effect", np.abs(ref - plain).max())
    assert np.abs(ref - plain).max() > 0.1  # the adapters matter ...
    assert np.abs(ref - got).max() <= 1e-4  # ... and msllm computes them as PEFT does


def test_one_training_step_loss_and_adapter_grads_equal_peft(base, alpaca_mindrecord):
    import mindspore as ms

    from msllm.lora.apply import apply_lora

    ids, labels = alpaca_rows(alpaca_mindrecord, 2, pool=50)  # real tokenized Alpaca rows, (2, 65)
    assert (labels != -100).sum() > 40
    net = msllm_net(base)
    apply_lora(net, PetConfig(lora_rank=8, lora_alpha=16, target_modules=".*wq|.*wk|.*wv|.*wo"))
    adapters = random_adapters(net, seed=SEED + 1, scale=0.05)
    net.set_train(True)
    loss, grads = ms.value_and_grad(net, grad_position=None, weights=net.trainable_params())(
        ms.Tensor(ids), ms.Tensor(labels))
    pm = peft_model(base, 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], adapters).train()
    out = pm(input_ids=torch.from_numpy(ids).long(), labels=torch.from_numpy(labels).long())
    out.loss.backward()
    ref_loss = out.loss.item()
    assert abs(float(loss.asnumpy()) - ref_loss) <= 1e-5 * abs(ref_loss)
    named = dict(pm.named_parameters())
    assert len(grads) == len(adapters) == 16
    for p, g in zip(net.trainable_params(), grads):
        ref = named["base_model.model." + p.name.replace(".weight", ".default.weight")].grad.numpy()
        rel = np.linalg.norm(g.asnumpy() - ref) / np.linalg.norm(ref)
        assert np.linalg.norm(ref) > 0 and rel <= 1e-5, (p.name, rel)
    # PEFT and msllm agree on what is trainable: exactly the adapters
    assert sorted(n for n, q in pm.named_parameters() if q.requires_grad) == sorted(peft_state(adapters))


def test_msllm_adapter_exported_loads_in_peft_with_the_same_logits(base, tmp_path):
    from msllm.lora.adapter import lora_record, read_adapter_manifest, save_adapter_checkpoint
    from msllm.lora.apply import apply_lora
    from msllm.convert.starting import base_identity
    from msllm.lora.peft import export_peft

    net = msllm_net(base)
    pet = PetConfig(lora_rank=4, lora_alpha=16, target_modules=".*wq|.*wv")
    info = apply_lora(net, pet)
    random_adapters(net, seed=SEED + 2, scale=0.05)
    path = str(tmp_path / "adapter.ckpt")
    save_adapter_checkpoint(net, net, path, lora_record(pet, info.modules, base_identity(base["ckpt"])),
                            model_config=net.config)
    assert read_adapter_manifest(path)["lora"]["base"]["path"] == os.path.abspath(base["ckpt"])
    out = str(tmp_path / "peft_out")
    # through the documented command line: convert_weight.py --reversed --lora ADAPTER --torch_ckpt_dir OUT
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "convert_weight.py"), "--reversed",
                        "--lora", path, "--torch_ckpt_dir", out], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(out, "adapter_config.json")) as fh:
        config = json.load(fh)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["r"] == 4 and config["lora_alpha"] == 16
    pm = peft.PeftModel.from_pretrained(hf_model(base), out).eval()
    ids = np.random.default_rng(SEED + 2).integers(0, 32000, (1, T)).astype(np.int32)
    assert np.abs(torch_logits(pm, ids) - logits(net, ids)).max() <= 1e-4
    with pytest.raises(MsllmError, match="not an empty directory"):
        export_peft(path, out)


@pytest.mark.parametrize("variant", ["plain", "rslora", "bin"])
def test_peft_adapter_imported_gives_peft_logits(base, tmp_path, variant):
    from msllm.lora.adapter import load_adapter_into, read_adapter_manifest
    from msllm.lora.peft import import_peft

    rslora = variant == "rslora"
    pm = peft_model(base, 8, 16, ["q_proj", "v_proj", "down_proj"], use_rslora=rslora)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(SEED)
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(str(tmp_path / "peft"), safe_serialization=variant != "bin")  # bin: adapter_model.bin
    assert os.path.exists(tmp_path / "peft" / ("adapter_model.bin" if variant == "bin" else "adapter_model.safetensors"))
    out = str(tmp_path / "imported.ckpt")
    manifest = import_peft(str(tmp_path / "peft"), out, base=base["ckpt"])
    rec = manifest["lora"]
    assert rec["source"] == "peft" and rec["base"]["sha256"] and len(rec["modules"]) == 6
    assert rec["pet_config"]["lora_alpha"] == pytest.approx(16 * 8 ** 0.5 if rslora else 16)
    assert read_adapter_manifest(out) == manifest
    net = msllm_net(base)
    load_adapter_into(net, out, base["ckpt"])
    ids = np.random.default_rng(SEED + 3).integers(0, 32000, (2, T)).astype(np.int32)
    assert np.abs(torch_logits(pm, ids) - logits(net, ids)).max() <= 1e-4


def test_peft_adapter_for_another_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from msllm.lora.peft import import_peft

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    pm = peft.get_peft_model(gpt2, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    pm.save_pretrained(str(tmp_path / "gpt2_lora"))
    out = str(tmp_path / "x.ckpt")
    with pytest.raises(MsllmError) as exc:
        import_peft(str(tmp_path / "gpt2_lora"), out)
    assert "fan_in_fan_out" in str(exc.value)
    # the same adapter without the Conv1D flag still names what is wrong: modules LLaMA lacks
    cfg_path = tmp_path / "gpt2_lora" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(cfg, fan_in_fan_out=False)))
    with pytest.raises(MsllmError) as exc:
        import_peft(str(tmp_path / "gpt2_lora"), out)
    assert "transformer.h.0.attn.c_attn" in str(exc.value) and "another architecture" in str(exc.value)
    assert not os.path.exists(out)


@pytest.mark.parametrize("edit, message", [
    ({"use_dora": True}, "use_dora=True is not vanilla LoRA"),
    ({"bias": "all"}, "bias='all'"),
    ({"rank_pattern": {"q_proj": 16}}, "rank_pattern"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "PREFIX_TUNING"}, "peft_type='PREFIX_TUNING'"),
    ({"r": 16}, "do not have rank r=16"),
])
def test_non_vanilla_or_inconsistent_peft_adapters_are_refused(base, tmp_path, edit, message):
    from msllm.lora.peft import import_peft

    pm = peft_model(base, 8, 16, ["q_proj"])
    pm.save_pretrained(str(tmp_path / "p"))
    cfg_path = tmp_path / "p" / "adapter_config.json"
    cfg_path.write_text(json.dumps(dict(json.loads(cfg_path.read_text()), **edit)))
    with pytest.raises(MsllmError, match=message.replace("[", r"\[").replace("(", r"\(")):
        import_peft(str(tmp_path / "p"), str(tmp_path / "x.ckpt"))
    assert not os.path.exists(tmp_path / "x.ckpt")


def test_adapter_is_refused_with_another_base(base, tmp_path):
    from msllm.convert.hf import convert_hf_to_msllm
    from msllm.convert.verify import make_random_hf_model
    from msllm.lora.adapter import load_adapter_into
    from msllm.lora.peft import import_peft

    pm = peft_model(base, 4, 8, ["q_proj"])
    pm.save_pretrained(str(tmp_path / "p"))
    out = str(tmp_path / "a.ckpt")
    import_peft(str(tmp_path / "p"), out, base=base["hf"])  # the HF directory as the base
    other_hf = str(tmp_path / "other_hf")
    make_random_hf_model(other_hf, seed=SEED + 9, **HF_CFG)  # same shapes, other weights
    convert_hf_to_msllm(other_hf, str(tmp_path / "other.ckpt"), progress=False)
    for other in (other_hf, str(tmp_path / "other.ckpt")):
        net = msllm_net(base)
        with pytest.raises(MsllmError, match="is not the base LoRA adapter .* was trained on"):
            load_adapter_into(net, out, other)
    load_adapter_into(msllm_net(base), out, base["hf"])  # the recorded base passes


def test_hf_directory_works_as_the_base(base):
    """load_checkpoint may name the HF directory itself: same weights as its msllm conversion."""
    from msllm.lora.apply import apply_lora
    from msllm.convert.starting import base_identity, load_base_into
    from msllm.models.llama.model import LlamaForCausalLM

    net = LlamaForCausalLM(base["config"], fast_paths=FAST["on"])
    apply_lora(net, PetConfig(target_modules=".*wv"))
    ident = load_base_into(net, base["hf"])
    assert ident == base_identity(base["hf"]) and ident["kind"] == "hf_dir"
    ids = np.arange(1, 20, dtype=np.int32).reshape(1, 19)
    assert np.array_equal(logits(net, ids), logits(msllm_net(base), ids))


def test_merged_adapter_converts_to_hf_and_gives_peft_logits(base, tmp_path):
    """PEFT adapter -> msllm import -> tools/merge_lora.py onto the HF-directory base ->
    convert_weight --reversed -> transformers: the logits of PEFT's unmerged model."""
    import subprocess
    import sys

    from lora_helpers import ROOT
    from msllm.convert.hf import convert_msllm_to_hf
    from msllm.convert.verify import hf_model as load
    from msllm.lora.peft import import_peft

    pm = peft_model(base, 8, 16, ALL[:-1])
    with torch.no_grad():
        gen = torch.Generator().manual_seed(SEED + 5)
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(str(tmp_path / "peft"))
    import_peft(str(tmp_path / "peft"), str(tmp_path / "a.ckpt"), base=base["hf"])
    merged = str(tmp_path / "merged.ckpt")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "merge_lora.py"), "--base", base["hf"],
                        "--lora", str(tmp_path / "a.ckpt"), "--output", merged, "--no_progress"],
                       capture_output=True, text=True, env=dict(os.environ, GLOG_v="3"), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    convert_msllm_to_hf(merged, str(tmp_path / "hf_merged"), progress=False)
    ids = np.random.default_rng(SEED + 5).integers(0, 32000, (2, T)).astype(np.int32)
    assert np.abs(torch_logits(load(str(tmp_path / "hf_merged")), ids) - torch_logits(pm, ids)).max() <= 1e-4


FAMILY_BASES = {"qwen2": dict(model_type="qwen2"),          # q/k/v biases
                 "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                                 router_aux_loss_coef=0.0)}   # experts (frozen: LoRA on attention)


@pytest.fixture(scope="module", params=sorted(FAMILY_BASES))
def family_base(tmp_path_factory, request):
    """A seeded random Qwen2 (q/k/v biases) or Mixtral (experts) directory and its msllm conversion."""
    from msllm.convert.hf import convert_hf_to_msllm
    from msllm.convert.verify import make_random_hf_model

    d = tmp_path_factory.mktemp("peft_" + request.param)
    make_random_hf_model(str(d / "hf"), seed=SEED + 5, bos_token_id=1, eos_token_id=2,
                         **{**HF_CFG, **FAMILY_BASES[request.param]})
    res = convert_hf_to_msllm(str(d / "hf"), str(d / "base.ckpt"), progress=False)
    assert res.config.qkv_has_bias or res.config.moe_config is not None
    return {"hf": str(d / "hf"), "ckpt": str(d / "base.ckpt"), "config": res.config, "dir": d}


def test_family_lora_step_freezes_the_base_and_equals_peft(family_base, alpaca_mindrecord):
    """Qwen2 / Mixtral with LoRA on q/k/v/o: the base biases and experts stay frozen (PEFT
    ``bias="none"``), the loss and every adapter gradient of one step equal PEFT's, and the logits
    with the adapters equal PEFT's."""
    import mindspore as ms

    from msllm.lora.apply import apply_lora

    ids, labels = alpaca_rows(alpaca_mindrecord, 2, pool=50)
    net = msllm_net(family_base)
    apply_lora(net, PetConfig(lora_rank=8, lora_alpha=16, target_modules=".*q_proj|.*k_proj|.*v_proj|.*o_proj"))
    adapters = random_adapters(net, seed=SEED + 3, scale=0.05)
    assert not [p.name for p in net.trainable_params() if "lora_" not in p.name]
    pm = peft_model(family_base, 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], adapters)
    probe = np.random.default_rng(SEED).integers(0, 32000, (1, T)).astype(np.int32)
    assert np.abs(torch_logits(pm, probe) - logits(net, probe)).max() <= 1e-4
    net.set_train(True)
    loss, grads = ms.value_and_grad(net, grad_position=None, weights=net.trainable_params())(
        ms.Tensor(ids), ms.Tensor(labels))
    pm.train()
    out = pm(input_ids=torch.from_numpy(ids).long(), labels=torch.from_numpy(labels).long())
    out.loss.backward()
    assert abs(float(loss.asnumpy()) - out.loss.item()) <= 1e-5 * abs(out.loss.item())
    named = dict(pm.named_parameters())
    for p, g in zip(net.trainable_params(), grads):
        ref = named["base_model.model." + p.name.replace(".weight", ".default.weight")].grad.numpy()
        assert np.linalg.norm(g.asnumpy() - ref) <= 1e-5 * np.linalg.norm(ref), p.name
    assert sorted(n for n, q in pm.named_parameters() if q.requires_grad) == sorted(peft_state(adapters))


def test_family_adapter_exported_and_imported_through_peft(family_base, tmp_path):
    """msllm adapter -> PEFT directory -> PeftModel on the HF Qwen2 gives msllm's logits; that
    directory imported back gives the same adapter weights."""
    from msllm.lora.adapter import lora_record, save_adapter_checkpoint
    from msllm.lora.apply import apply_lora
    from msllm.convert.starting import base_identity
    import mindspore as ms

    from msllm.lora.peft import export_peft, import_peft

    net = msllm_net(family_base)
    pet = PetConfig(lora_rank=4, lora_alpha=16, target_modules=".*q_proj|.*v_proj")
    info = apply_lora(net, pet)
    adapters = random_adapters(net, seed=SEED + 4, scale=0.05)
    path = str(tmp_path / "adapter.ckpt")
    save_adapter_checkpoint(net, net, path, lora_record(pet, info.modules, base_identity(family_base["ckpt"])),
                            model_config=net.config)
    export_peft(path, str(tmp_path / "peft"))
    pm = peft.PeftModel.from_pretrained(hf_model(family_base), str(tmp_path / "peft")).eval()
    ids = np.random.default_rng(SEED + 4).integers(0, 32000, (1, T)).astype(np.int32)
    assert np.abs(torch_logits(pm, ids) - logits(net, ids)).max() <= 1e-4
    back = str(tmp_path / "back.ckpt")
    import_peft(str(tmp_path / "peft"), back, base=family_base["ckpt"])
    got = {k: v.asnumpy() for k, v in ms.load_checkpoint(back).items()}
    for name, value in adapters.items():
        np.testing.assert_array_equal(got[name], value)
