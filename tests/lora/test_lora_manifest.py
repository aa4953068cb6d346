"""LoRA's settings in checkpoint manifests: written under their own ``"pet_config"`` key; manifests
written before (``pet_config`` inside ``"model_config"``) still load, with their adapters applied,
and every reader that builds a LlamaConfig from a manifest drops that key first
(:func:`msllm.formats.manifest.manifest_model_config` / :func:`~msllm.formats.manifest.manifest_pet_config`)."""

import dataclasses

import numpy as np
import pytest

from lora_helpers import SEED, build, logits, random_adapters, save_base, set_mode, tiny_config
from msllm.config_lora import PetConfig
from msllm.models.llama.config import LlamaConfig

PET = PetConfig(lora_rank=4, lora_alpha=8, target_modules=".*wq|.*wv")


def test_manifest_helpers_read_both_forms(tmp_path):
    from msllm.formats.manifest import manifest_model_config, manifest_pet_config, write_sidecar

    cfg = tiny_config()
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"weights")
    new = write_sidecar(str(path), cfg, PET, step=1)
    assert new["pet_config"] == dataclasses.asdict(PET) and "pet_config" not in new["model_config"]
    old = dict(new, model_config={**new["model_config"], "pet_config": dataclasses.asdict(PET)})
    del old["pet_config"]
    for manifest in (new, old):
        assert manifest_pet_config(manifest) == PET
        assert manifest_model_config(manifest) == dataclasses.asdict(cfg)
    # a full-model manifest of before: pet_config null inside model_config
    plain = dict(old, model_config={**new["model_config"], "pet_config": None})
    assert manifest_pet_config(plain) is None and manifest_model_config(plain) == dataclasses.asdict(cfg)
    assert "pet_config" not in write_sidecar(str(path), cfg)   # no LoRA: no key


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """A tiny model with random base weights and random adapters, saved whole (base + adapters)."""
    import mindspore as ms

    from msllm.lora.apply import apply_lora

    set_mode("graph")
    d = tmp_path_factory.mktemp("lora_manifest")
    cfg = tiny_config()
    net = build(cfg)
    base = save_base(net, str(d / "base.ckpt"))
    apply_lora(net, PET, seed=SEED, dropout=0.0)
    random_adapters(net)
    full = str(d / "full.ckpt")
    ms.save_checkpoint(net, full)
    ids = np.array([[1, 306, 5360, 1522, 29892, 7, 9, 11]], np.int32)
    return {"dir": d, "cfg": cfg, "net": net, "base": base, "full": full, "ids": ids, "want": logits(net, ids)}


def _run_config(mc):
    from msllm.config import ModelSection, RunConfig

    return RunConfig(model=ModelSection(model_config=mc))


@pytest.mark.parametrize("form", ["new", "old"])
def test_a_checkpoint_with_adapters_loads_them_from_either_manifest_form(lora_model, form):
    """A checkpoint holding base and adapters: the manifest's pet_config (its own key, or inside
    model_config as written before) re-applies the adapters; the logits are the adapted model's."""
    from msllm.formats.manifest import write_sidecar
    from msllm.generation.loading import load_for_inference

    cfg, full = lora_model["cfg"], lora_model["full"]
    if form == "new":
        write_sidecar(full, cfg, PET)
    else:
        write_sidecar(full, {**dataclasses.asdict(cfg), "pet_config": dataclasses.asdict(PET)})
    net, mc, _ = load_for_inference(_run_config(cfg), full)
    assert not hasattr(mc, "pet_config") and net.lora_info.modules == lora_model["net"].lora_info.modules
    np.testing.assert_allclose(logits(net, lora_model["ids"]), lora_model["want"], atol=1e-5)
    # a run YAML that names no model takes the manifest's model config (pet_config dropped)
    net, mc, _ = load_for_inference(_run_config(LlamaConfig()), full)
    assert mc.hidden_size == cfg.hidden_size
    np.testing.assert_allclose(logits(net, lora_model["ids"]), lora_model["want"], atol=1e-5)


def test_an_adapter_manifest_of_before_still_loads_and_merges(lora_model, tmp_path):
    """An adapter checkpoint whose manifest keeps pet_config inside model_config (as written before):
    model_config_of, load_adapter_into and merge read it; the new form round-trips."""
    import json

    from msllm.convert.starting import base_identity
    from msllm.formats.manifest import read_sidecar, sidecar_path
    from msllm.generation.loading import load_for_inference
    from msllm.lora.adapter import lora_record, model_config_of, save_adapter_checkpoint
    from msllm.lora.merge import merge_lora_checkpoint

    net, cfg = lora_model["net"], lora_model["cfg"]
    adapter = str(tmp_path / "adapter.ckpt")
    save_adapter_checkpoint(net, net, adapter, lora_record(PET, net.lora_info.modules,
                                                           base_identity(lora_model["base"])), model_config=cfg)
    new = read_sidecar(adapter)
    assert new["pet_config"] == dataclasses.asdict(PET) and "pet_config" not in new["model_config"]
    assert model_config_of(new) == cfg
    old = dict(new, model_config={**new["model_config"], "pet_config": new.pop("pet_config")})
    with open(sidecar_path(adapter), "w", encoding="utf-8") as fh:
        json.dump(old, fh)
    assert model_config_of(read_sidecar(adapter)) == cfg
    got, _, _ = load_for_inference(_run_config(cfg), lora_model["base"], adapter=adapter)
    np.testing.assert_allclose(logits(got, lora_model["ids"]), lora_model["want"], atol=1e-5)
    merged = merge_lora_checkpoint(lora_model["base"], adapter, str(tmp_path / "merged.ckpt"))
    assert "pet_config" not in merged and "pet_config" not in merged["model_config"]
