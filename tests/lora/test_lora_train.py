"""LoRA fine-tuning steps in GRAPH mode on real Alpaca data, through msllm's own TrainStep:
only the adapters get gradients and AdamW moments; the base weights stay bit-identical; the
adapter checkpoint holds adapters + optimizer state only, with the base's identity; resuming from
it continues bit-exactly; the merged checkpoint gives the unmerged model's logits (1e-5); a base
whose SHA-256 differs is refused by resume, merge and tools/merge_lora.py (exit 2, no output)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from lora_helpers import ROOT, SEED, alpaca_rows, build, save_base, set_mode, tiny_config
from msllm.errors import MsllmError
from msllm.config_lora import PetConfig

PET = PetConfig(lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=".*wq|.*wk|.*wv|.*wo")
STEPS = 3


def lora_step(cfg, base_path):
    """The objects the trainer builds for a LoRA fine-tune, with msllm's TrainStep."""
    import mindspore as ms
    from mindspore import nn

    from msllm.lora.apply import apply_lora
    from msllm.convert.starting import load_base_into
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.step import TrainStep

    net = LlamaForCausalLM(cfg, fast_paths=True)
    identity = load_base_into(net, base_path)
    info = apply_lora(net, PET, seed=SEED)
    params = net.trainable_params()
    opt = nn.AdamWeightDecay([{"params": params, "weight_decay": 0.1}],
                             learning_rate=ms.Tensor(np.full(16, 5e-3, np.float32)), beta1=0.9, beta2=0.95)
    step = TrainStep(net, opt, loss_scale="dynamic", scale_sense=65536.0, max_grad_norm=1.0)
    step.set_train()
    return net, opt, step, info, identity


@pytest.fixture(scope="module")
def run(tmp_path_factory, alpaca_mindrecord):
    """Base checkpoint; STEPS + 1 LoRA steps on real batches; adapter checkpoints after STEPS and STEPS + 1."""
    import mindspore as ms

    from msllm.lora.adapter import lora_record, save_adapter_checkpoint

    set_mode("graph")
    ms.set_seed(SEED)
    print("seed", SEED)
    d = tmp_path_factory.mktemp("lora_train")
    cfg = tiny_config()
    base_path = save_base(build(cfg), str(d / "base.ckpt"))
    ids, labels = alpaca_rows(alpaca_mindrecord, 4 * (STEPS + 1), pool=80)
    batches = [(ms.Tensor(ids[4 * k:4 * k + 4]), ms.Tensor(labels[4 * k:4 * k + 4])) for k in range(STEPS + 1)]
    net, opt, step, info, identity = lora_step(cfg, base_path)
    losses = [float(step(*batches[k])[0].asnumpy()) for k in range(STEPS)]
    record = lora_record(PET, info.modules, identity)
    ckpt3 = save_adapter_checkpoint(step, net, str(d / "lora_3.ckpt"), record, epoch=1, step=STEPS, model_config=cfg)
    losses.append(float(step(*batches[STEPS])[0].asnumpy()))
    ckpt4 = save_adapter_checkpoint(step, net, str(d / "lora_4.ckpt"), record, epoch=1, step=STEPS + 1,
                                    model_config=cfg)
    return {"dir": d, "cfg": cfg, "base": base_path, "batches": batches, "net": net, "opt": opt, "step": step,
            "info": info, "losses": losses, "ckpt3": ckpt3, "ckpt4": ckpt4, "identity": identity,
            "final": {p.name: p.asnumpy().copy() for p in step.get_parameters()}}


def test_only_adapters_train_and_the_base_stays_bit_identical(run):
    import mindspore as ms

    from msllm.lora.apply import adapter_param_names

    assert all(np.isfinite(run["losses"]))
    adapters = adapter_param_names(run["net"])
    assert [p.name for p in run["opt"].parameters] == adapters  # gradients and updates: adapters only
    moments = sorted(p.name for p in run["step"].get_parameters() if p.name.startswith(("adam_m.", "adam_v.")))
    assert moments == sorted([f"adam_m.{n}" for n in adapters] + [f"adam_v.{n}" for n in adapters])
    base = ms.load_checkpoint(run["base"])
    final = run["final"]
    for name, value in base.items():
        assert np.array_equal(final[name], value.asnumpy()), name  # frozen: bit for bit
    for name in adapters:
        if name.endswith("lora_B.weight"):
            assert np.abs(final[name]).max() > 0, name  # B left zero: the adapters did train


def test_adapter_checkpoint_holds_adapters_optimizer_state_and_base_identity(run):
    from msllm.formats.manifest import read_sidecar
    from msllm.formats.mindspore_ckpt import scan_checkpoint
    from msllm.lora.apply import adapter_param_names
    from msllm.convert.starting import base_identity

    names = set(scan_checkpoint(run["ckpt3"]))
    adapters = set(adapter_param_names(run["net"]))
    assert adapters <= names
    assert {f"adam_m.{n}" for n in adapters} <= names and {f"adam_v.{n}" for n in adapters} <= names
    assert {"global_step", "loss_scale", "epoch_num", "step_num"} <= names
    base_names = set(scan_checkpoint(run["base"]))
    assert not names & base_names  # no base weight in the adapter checkpoint
    assert os.path.getsize(run["ckpt3"]) < 0.05 * os.path.getsize(run["base"])
    manifest = read_sidecar(run["ckpt3"])
    assert manifest["step"] == STEPS and manifest["lora"]["format"] == "msllm-lora-v1"
    assert manifest["lora"]["base"] == base_identity(run["base"]) == run["identity"]
    assert manifest["lora"]["pet_config"]["lora_rank"] == 4 and len(manifest["lora"]["modules"]) == 8
    # LoRA's settings under their own key; the model config is the model's only
    assert manifest["pet_config"] == manifest["lora"]["pet_config"] and "pet_config" not in manifest["model_config"]


def test_resume_from_the_adapter_checkpoint_is_bit_exact(run):
    from msllm.lora.adapter import load_adapter_state

    net, _, step, _, _ = lora_step(run["cfg"], run["base"])
    load_adapter_state(step, net, run["ckpt3"], run["base"])
    loss = float(step(*run["batches"][STEPS])[0].asnumpy())
    assert loss == run["losses"][STEPS]
    for p in step.get_parameters():
        assert np.array_equal(p.asnumpy(), run["final"][p.name]), p.name


def test_merged_checkpoint_gives_the_unmerged_logits(run, tmp_path):
    import mindspore as ms

    from msllm.formats.manifest import read_sidecar
    from msllm.lora.merge import merge_lora_checkpoint
    from msllm.models.llama.model import LlamaForCausalLM

    out = str(tmp_path / "merged.ckpt")
    manifest = merge_lora_checkpoint(run["base"], run["ckpt4"], out)
    assert "pet_config" not in manifest and "pet_config" not in manifest["model_config"]
    assert read_sidecar(out)["sha256"] == manifest["sha256"]
    assert manifest["merged_from"]["base"]["sha256"] == run["identity"]["sha256"]
    ids = run["batches"][0][0][:, :-1]
    run["net"].set_train(False)
    unmerged = run["net"](ids).asnumpy()
    plain = LlamaForCausalLM(run["cfg"])
    ms.load_param_into_net(plain, ms.load_checkpoint(out))
    plain.set_train(False)
    merged = plain(ids).asnumpy()
    base_net = LlamaForCausalLM(plain.config)
    ms.load_param_into_net(base_net, ms.load_checkpoint(run["base"]))
    base_net.set_train(False)
    assert np.abs(unmerged - base_net(ids).asnumpy()).max() > 1e-3  # training moved the logits
    assert np.abs(unmerged - merged).max() <= 1e-5, np.abs(unmerged - merged).max()


def tampered_base(run, tmp_path) -> str:
    """A copy of the base with one weight changed (same shapes, different SHA-256)."""
    import mindspore as ms

    params = ms.load_checkpoint(run["base"])
    w = params["model.layers.0.self_attn.q_proj.weight"]
    w.set_data(ms.Tensor(w.asnumpy() + 1e-3))
    path = str(tmp_path / "other_base.ckpt")
    ms.save_checkpoint([{"name": k, "data": v} for k, v in params.items()], path)
    return path


def test_mismatched_base_is_refused_on_resume_and_merge(run, tmp_path):
    from msllm.lora.adapter import load_adapter_state
    from msllm.lora.merge import merge_lora_checkpoint

    other = tampered_base(run, tmp_path)
    net, _, step, _, _ = lora_step(run["cfg"], other)
    with pytest.raises(MsllmError, match="is not the base LoRA checkpoint .* was trained on"):
        load_adapter_state(step, net, run["ckpt3"], other)
    out = str(tmp_path / "m.ckpt")
    with pytest.raises(MsllmError, match="SHA-256"):
        merge_lora_checkpoint(other, run["ckpt3"], out)
    assert not os.path.exists(out)
    with pytest.raises(MsllmError, match="not a LoRA adapter"):
        merge_lora_checkpoint(run["ckpt3"], run["base"], out)  # arguments swapped


def test_merge_lora_tool(run, tmp_path):
    tool = os.path.join(ROOT, "tools", "merge_lora.py")
    env = dict(os.environ, GLOG_v="3")
    out = str(tmp_path / "merged.ckpt")
    p = subprocess.run([sys.executable, tool, "--base", run["base"], "--lora", run["ckpt4"], "--output", out,
                        "--no_progress"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "merged 8 module(s) (rank 4, scale 2)" in p.stdout and os.path.exists(out + ".json")
    bad = str(tmp_path / "bad.ckpt")
    p = subprocess.run([sys.executable, tool, "--base", tampered_base(run, tmp_path), "--lora", run["ckpt4"],
                        "--output", bad, "--no_progress"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "SHA-256" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not os.path.exists(bad)
