"""pet_config semantics: validation messages, and which modules a target_modules regex selects in
msllm/HF and MindFormers naming (pure Python, no MindSpore)."""

import re

import pytest

from lora_helpers import tiny_config
from msllm.errors import MsllmError
from msllm.config_lora import lora_scale, validate_pet_config
from msllm.lora.targets import (adapter_shapes, describe_modules, exact_target_regex, linear_modules, match_targets,
                                mindformers_module_name)
from msllm.config_lora import PetConfig


@pytest.mark.parametrize("kw, message", [
    (dict(pet_type="ptuning2"), "pet_type='ptuning2' is not available in msllm; it has: lora"),
    (dict(pet_type="prefix_tuning"), "it has: lora"),
    (dict(lora_rank=0), "lora_rank=0: expected an integer > 0"),
    (dict(lora_rank=-4), "lora_rank=-4"),
    (dict(lora_alpha=0.0), "lora_alpha=0.0"),
    (dict(lora_dropout=1.0), "0 <= lora_dropout < 1"),
    (dict(target_modules="(.*wq"), "not a valid regex"),
    (dict(target_modules=""), "expected a regex"),
    (dict(lora_a_init="orthogonal"), "lora_a_init='orthogonal': expected one of kaiming_uniform, gaussian, normal"),
    (dict(lora_b_init="normal"), "lora_b_init='normal': expected zeros"),
])
def test_bad_pet_config_one_clear_error(kw, message):
    with pytest.raises(MsllmError) as exc:
        validate_pet_config(PetConfig(**kw))
    assert message in str(exc.value)
    assert str(exc.value).startswith("pet_config.")  # the run config's section (msllm.config_lora.WHERE)


def test_good_pet_configs_and_scale():
    validate_pet_config(None)  # full fine-tuning
    validate_pet_config(PetConfig(lora_b_init="zero", lora_a_init="normal"))  # MindFormers' spellings
    assert lora_scale(PetConfig(lora_rank=8, lora_alpha=16)) == 2.0
    assert lora_scale(PetConfig(lora_rank=64, lora_alpha=16)) == 0.25


def test_mindformers_and_hf_regexes_select_the_same_modules():
    cfg = tiny_config(num_layers=3)
    mf = match_targets(cfg, ".*wq|.*wv")
    hf = match_targets(cfg, ".*q_proj|.*v_proj")
    bare = match_targets(cfg, "q_proj|v_proj")
    assert mf == hf == bare == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(3) for p in "qv"]
    # MindFormers' recipe targets: attention only
    assert len(match_targets(cfg, ".*wq|.*wk|.*wv|.*wo")) == 3 * 4
    # all linear layers, both namings mixed; w1/w3/w2 are gate/up/down
    assert match_targets(cfg, r".*\.w[123]") == [f"model.layers.{i}.mlp.{p}_proj" for i in range(3)
                                                for p in ("gate", "up", "down")]
    assert match_targets(cfg, ".*") == list(linear_modules(cfg))
    assert "lm_head" in match_targets(cfg, "lm_head")
    # one layer only, by its full name
    assert match_targets(cfg, r"model\.layers\.1\.attention\.wo") == ["model.layers.1.self_attn.o_proj"]
    assert mindformers_module_name("model.layers.2.mlp.up_proj") == "model.layers.2.feed_forward.w3"


def test_regex_matching_nothing_names_the_available_modules():
    with pytest.raises(MsllmError) as exc:
        match_targets(tiny_config(), ".*query_key_value")
    msg = str(exc.value)
    assert "matches no module" in msg
    for name in ("model.layers.{i}.self_attn.q_proj", "model.layers.{i}.mlp.down_proj", "lm_head",
                 "model.layers.{i}.attention.wq", "model.layers.{i}.feed_forward.w2", "i = 0..1"):
        assert name in msg, name


def test_tied_embeddings_have_no_lm_head_target():
    with pytest.raises(MsllmError, match="matches no module"):
        match_targets(tiny_config(tie_word_embeddings=True), "lm_head")


def test_adapter_shapes_follow_the_base_weights():
    cfg = tiny_config()  # hidden 64, 4 heads of 16, 2 kv heads, ffn 96, vocab 32000
    shapes = adapter_shapes(cfg, match_targets(cfg, ".*k_proj|.*down_proj|lm_head"), 8)
    assert shapes["model.layers.0.self_attn.k_proj.lora_A.weight"] == (8, 64)
    assert shapes["model.layers.0.self_attn.k_proj.lora_B.weight"] == (32, 8)      # 2 kv heads x 16
    assert shapes["model.layers.1.mlp.down_proj.lora_A.weight"] == (8, 96)
    assert shapes["model.layers.1.mlp.down_proj.lora_B.weight"] == (64, 8)
    assert shapes["lm_head.lora_B.weight"] == (32000, 8)


def test_exact_target_regex_selects_exactly_its_modules():
    cfg = tiny_config(num_layers=4)
    for chosen in (match_targets(cfg, ".*q_proj|.*v_proj"),
                   ["model.layers.0.self_attn.q_proj", "model.layers.3.mlp.up_proj", "lm_head"]):
        regex = exact_target_regex(chosen)
        assert match_targets(cfg, regex) == chosen
        assert [m for m in linear_modules(cfg) if re.fullmatch(regex, m)] == chosen
    assert describe_modules(match_targets(cfg, ".*q_proj")) == "model.layers.{0-3}.self_attn.q_proj"


def test_run_yaml_accepts_mindformers_pet_config_keys(repo_root):
    import os

    from msllm.config import load_config

    cfg = load_config(os.path.join(repo_root, "configs", "llama", "run_llama_tiny.yaml"), [
        "--model.model_config.pet_config.pet_type=lora", "--model.model_config.pet_config.lora_rank=16",
        "--model.model_config.pet_config.lora_alpha=16", "--model.model_config.pet_config.lora_dropout=0.05",
        "--model.model_config.pet_config.target_modules=.*wq|.*wk|.*wv|.*wo"])
    pc = cfg.pet_config   # MindFormers' place, moved to the run config's own section
    assert (pc.pet_type, pc.lora_rank, pc.lora_alpha, pc.lora_dropout) == ("lora", 16, 16.0, 0.05)
    assert not hasattr(cfg.model_config, "pet_config")  # the model config describes the model only
    validate_pet_config(pc)
    assert len(match_targets(cfg.model_config, pc.target_modules)) == 4 * cfg.model_config.num_layers


def _tiny(repo_root):
    import os

    return os.path.join(repo_root, "configs", "llama", "run_llama_tiny.yaml")


def test_both_override_spellings_are_one_setting(repo_root, tmp_path):
    """--model.model_config.pet_config[.KEY] (MindFormers' place: README, configs/ comments,
    scripts/run_demo.sh) and --pet_config[.KEY] set the same section; over a YAML that has the
    section (a saved msllm_config.yaml) the override wins, as any override does."""
    from msllm.config import load_config, save_config

    tiny = _tiny(repo_root)
    whole = load_config(tiny, ["--model.model_config.pet_config={lora_rank: 4, lora_alpha: 8}"])
    assert (whole.pet_config.lora_rank, whole.pet_config.lora_alpha) == (4, 8.0)
    assert whole == load_config(tiny, ["--pet_config={lora_rank: 4, lora_alpha: 8}"])
    mixed = load_config(tiny, ["--model.model_config.pet_config.lora_rank=4", "--pet_config.lora_alpha=8"])
    assert mixed.pet_config == whole.pet_config
    assert load_config(tiny).pet_config is None  # no LoRA unless asked
    saved = str(tmp_path / "msllm_config.yaml")
    save_config(mixed, saved)
    with open(saved, encoding="utf-8") as fh:
        text = fh.read()
    assert "\npet_config:\n" in text and "    pet_config" not in text  # top level, not in model_config
    assert load_config(saved) == mixed   # loads back equal
    again = load_config(saved, ["--model.model_config.pet_config.lora_rank=6"])
    assert again.pet_config.lora_rank == 6 and again.pet_config.lora_alpha == 8.0


def test_the_yaml_may_keep_mindformers_place_and_both_places_must_agree(repo_root, tmp_path):
    import yaml

    from msllm.config import load_config

    with open(_tiny(repo_root), encoding="utf-8") as fh:
        base = yaml.safe_load(fh)

    def write(**sections):
        data = {**base, **{k: v for k, v in sections.items() if k != "mc_pet"}}
        data["model"] = {"model_config": dict(base["model"]["model_config"])}
        if "mc_pet" in sections:
            data["model"]["model_config"]["pet_config"] = sections["mc_pet"]
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(data), encoding="utf-8")
        return str(path)

    cfg = load_config(write(mc_pet={"pet_type": "lora", "lora_rank": 16}))
    assert cfg.pet_config.lora_rank == 16
    # both places: the same values join; a key with two values is one error naming both keys
    cfg = load_config(write(mc_pet={"lora_rank": 16}, pet_config={"lora_rank": 16, "lora_alpha": 4}))
    assert (cfg.pet_config.lora_rank, cfg.pet_config.lora_alpha) == (16, 4.0)
    with pytest.raises(MsllmError) as exc:
        load_config(write(mc_pet={"lora_rank": 16}, pet_config={"lora_rank": 8}))
    assert "model.model_config.pet_config.lora_rank=16" in str(exc.value)
    assert "pet_config.lora_rank=8" in str(exc.value) and "run.yaml" in str(exc.value)
    with pytest.raises(MsllmError, match="--model.model_config.pet_config.lora_rank=4 and --pet_config.lora_rank=3"):
        load_config(_tiny(repo_root), ["--model.model_config.pet_config.lora_rank=4", "--pet_config.lora_rank=3"])
    # a bad key or value names the section's key
    with pytest.raises(MsllmError, match="unknown config key 'pet_config.lora_rnk'; did you mean 'lora_rank'"):
        load_config(_tiny(repo_root), ["--model.model_config.pet_config.lora_rnk=4"])
    with pytest.raises(MsllmError, match="pet_config.lora_rank=0: expected an integer > 0"):
        load_config(_tiny(repo_root), ["--pet_config.lora_rank=0"])
