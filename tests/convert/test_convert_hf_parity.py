"""HF -> msllm conversion proven by logits parity: random seeded transformers LLaMAs of several
shapes and file layouts, converted, run on a real sentence (real LLaMA tokenizer) through both
frameworks: max |logit diff| < 1e-4 and the same greedy continuation."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from helpers.families import FAMILY_CASES
from msllm.convert import hf
from msllm.convert.verify import check_parity, make_random_hf_model
from msllm.training.checkpoint import read_sidecar

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "convert_weight.py")

# name -> (transformers LlamaConfig fields, file format, shard size, stored dtype)
CASES = {
    # multi-head attention, untied head, odd SwiGLU width, real 32000 vocabulary (no id folding)
    "mha_untied_ffn37_vocab32000": (dict(vocab_size=32000, hidden_size=32, intermediate_size=37,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=128), "safetensors", None, "float32"),
    # grouped-query attention, tied embeddings, LLaMA-3 rope base, sharded safetensors + index
    "gqa_tied_theta5e5_sharded": (dict(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                       rope_theta=500000.0, tie_word_embeddings=True,
                                       max_position_embeddings=96), "safetensors", "40KB", "float32"),
    # linear rope scaling, rope base 1e6, pytorch_model.bin
    "gqa_linear_rope_bin": (dict(vocab_size=500, hidden_size=48, intermediate_size=37, num_hidden_layers=2,
                                 num_attention_heads=6, num_key_value_heads=3, rope_theta=1e6,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0},
                                 max_position_embeddings=256), "bin", None, "float32"),
    # multi-query attention, sharded .bin + index, bf16 storage kept as bf16
    "mqa_bin_sharded_bf16": (dict(vocab_size=700, hidden_size=32, intermediate_size=50, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-5,
                                  max_position_embeddings=64), "bin", "sharded", "bfloat16"),
    # Llama 3.1+ rotary scaling (rope_type llama3: kept, blended and divided frequencies at head_dim 16)
    "gqa_llama3_rope": (dict(vocab_size=600, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                             max_position_embeddings=512), "safetensors", None, "float32"),
    # the family's other members (the generation tests' configs: one table)
    **{k: (kw, "safetensors", None, "float32") for k, kw in FAMILY_CASES.items()},
}
# what each family's config becomes in msllm (independently written from transformers' modeling files)
FAMILY_SWITCHES = {
    "qwen2_bias_yarn": dict(qkv_has_bias=True, attention_bias=False),
    "qwen3_qknorm_head_dim": dict(qk_norm=True, head_dim=32),
    "mistral_window16": dict(sliding_window=16),
    "gemma_geglu_mqa": dict(rms_norm_offset=1.0, hidden_act="gelu_pytorch_tanh", embedding_multiplier=8.0,
                            head_dim=24, tie_word_embeddings=True),
    "llama_attention_bias": dict(attention_bias=True, qkv_has_bias=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_msllm_logits_parity(tmp_path, case):
    cfg_kw, fmt, shard, dtype = CASES[case]
    seed = list(CASES).index(case) + 11  # hash() of a str differs per process (PYTHONHASHSEED)
    print(f"seed {seed}")
    model = make_random_hf_model(str(tmp_path / "hf"), seed=seed, dtype=dtype, fmt=fmt,
                                 max_shard_size=shard, **cfg_kw)
    files = sorted(os.listdir(tmp_path / "hf"))
    if shard:
        assert any(f.endswith(".index.json") for f in files)
        assert sum(f.endswith((".safetensors", ".bin")) for f in files) >= 2, files
    out = str(tmp_path / "m.ckpt")
    res = hf.convert_hf_to_msllm(str(tmp_path / "hf"), out, progress=False)
    c = res.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.kv_heads, c.ffn_size) == (
        cfg_kw["vocab_size"], cfg_kw["hidden_size"], cfg_kw["num_hidden_layers"],
        cfg_kw["num_attention_heads"], cfg_kw["num_key_value_heads"], cfg_kw["intermediate_size"])
    assert c.model_type == cfg_kw.get("model_type", "llama")
    for key, value in {"tie_word_embeddings": cfg_kw.get("tie_word_embeddings", False),
                       **FAMILY_SWITCHES.get(case, {})}.items():
        assert getattr(c, key) == value, key
    assert c.rope_theta == model.config.rope_parameters["rope_theta"]   # the family's default if not given
    expected_scaling = {"gqa_linear_rope_bin": {"type": "linear", "factor": 2.0},
                        "gqa_llama3_rope": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                        "qwen2_bias_yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    assert c.rope_scaling == expected_scaling.get(case)
    assert res.dtypes == [dtype]
    # the manifest carries the model config, so the checkpoint is self-describing
    assert read_sidecar(out)["model_config"]["hidden_size"] == cfg_kw["hidden_size"]

    for fast in (False, True):  # the layout path's composed operators and the CPU kernels
        report = check_parity(c, out, hf=model, fast_paths=fast)  # model holds the saved (rounded) weights
        print("fast paths" if fast else "composed", "\n".join(report.lines()))
        assert report.reference_std > 0.3  # logits are O(1): 1e-4 is a real bound, not a vacuous one
        # relative to the logits' size: Gemma's sqrt(hidden)-scaled tied embeddings give logits ~10
        assert report.max_abs_diff < 1e-4 * max(1.0, report.reference_std)
        assert report.hf_next == report.msllm_next
        assert report.modulo_vocab == (cfg_kw["vocab_size"] < 32000)


@pytest.mark.parametrize("case,switch", [("mistral_window16", dict(sliding_window=None)),
                                         ("qwen3_qknorm_head_dim", None), ("gemma_geglu_mqa", None),
                                         ("qwen2_bias_yarn", dict(rope_scaling=None))])
def test_each_family_switch_matters(tmp_path, case, switch):
    """The parity above is not vacuous: msllm without one of the family's switches (the window, the
    q/k norms, Gemma's norm offset, YaRN) is far from transformers on the same weights."""
    import dataclasses

    cfg_kw = CASES[case][0]
    model = make_random_hf_model(str(tmp_path / "hf"), seed=7, **cfg_kw)
    out = str(tmp_path / "m.ckpt")
    c = hf.convert_hf_to_msllm(str(tmp_path / "hf"), out, progress=False).config
    good = check_parity(c, out, hf=model)
    assert good.max_abs_diff < 1e-4 * max(1.0, good.reference_std)
    if case == "qwen3_qknorm_head_dim":   # q/k norm weights 1 + N(0, 0.2): set them to 1 on msllm's side only
        bad_ckpt = str(tmp_path / "bad.ckpt")
        with hf.CkptWriter(bad_ckpt) as w:
            for name, (data, dtype) in hf.read_msllm_tensors(out).items():
                w.write(name, np.ones_like(data) if "_norm." in name and "self_attn" in name else data, dtype)
        bad = check_parity(c, bad_ckpt, hf=model)
    elif case == "gemma_geglu_mqa":       # a LLaMA norm (w instead of 1 + w)
        bad = check_parity(dataclasses.replace(c, rms_norm_offset=0.0), out, hf=model)
    else:
        bad = check_parity(dataclasses.replace(c, **switch), out, hf=model)
    print(case, "with the switch", good.max_abs_diff, "without", bad.max_abs_diff)
    assert bad.max_abs_diff > 1e-2


def test_a_wrong_layout_fails_the_parity_check(tmp_path):
    """The check is sensitive: Meta-ordering one layer's q/k rows (a classic conversion bug)
    moves the logits by orders of magnitude more than the tolerance."""
    cfg_kw = CASES["gqa_tied_theta5e5_sharded"][0]
    model = make_random_hf_model(str(tmp_path / "hf"), seed=3, **cfg_kw)
    good = str(tmp_path / "good.ckpt")
    res = hf.convert_hf_to_msllm(str(tmp_path / "hf"), good, progress=False)
    bad = str(tmp_path / "bad.ckpt")
    with hf.CkptWriter(bad) as w:
        for name, (data, dtype) in hf.read_msllm_tensors(good).items():
            if name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
                heads = res.config.num_heads if "q_proj" in name else res.config.kv_heads
                data = hf.permute_hf_to_meta(data, heads)
            w.write(name, data, dtype)
    report = check_parity(res.config, bad, hf=model)
    assert report.max_abs_diff > 1e-2 and not report.ok


@pytest.mark.parametrize("fast", [False, True], ids=["ascend_path", "cpu_fast_path"])
def test_graph_mode_gives_the_same_logits(tmp_path, fast):
    cfg_kw = dict(vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = make_random_hf_model(str(tmp_path / "hf"), seed=5, **cfg_kw)
    out = str(tmp_path / "m.ckpt")
    res = hf.convert_hf_to_msllm(str(tmp_path / "hf"), out, progress=False)
    import mindspore as ms
    before = ms.get_context("mode")
    report = check_parity(res.config, out, hf=model, mode="graph", n_new=2, fast_paths=fast)
    assert report.max_abs_diff < 1e-4 and report.hf_next == report.msllm_next
    assert ms.get_context("mode") == before  # the check leaves the process's mode alone


def test_cli_hf_to_msllm_with_verify_prints_the_model_config(tmp_path):
    cfg_kw = CASES["gqa_linear_rope_bin"][0]
    make_random_hf_model(str(tmp_path / "hf"), seed=11, fmt="safetensors", **cfg_kw)
    out = tmp_path / "out" / "llama.ckpt"
    r = subprocess.run([sys.executable, TOOL, "--torch_ckpt_dir", str(tmp_path / "hf"),
                        "--mindspore_ckpt_path", str(out), "--verify", "--no_progress"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, GLOG_v="3"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "verify: PASSED" in r.stdout
    diff = float(r.stdout.split("max |logit diff| = ")[1].split()[0])
    assert diff < 1e-4
    # the printed block is a valid run-YAML fragment describing the model
    block = yaml.safe_load(r.stdout.split("# model_config for a run YAML")[1].split("\n", 1)[1])
    mc = block["model"]["model_config"]
    assert mc["num_layers"] == 2 and mc["num_heads"] == 6 and mc["n_kv_heads"] == 3
    assert mc["intermediate_size"] == 37 and mc["rope_theta"] == 1e6
    assert mc["rope_scaling"] == {"type": "linear", "factor": 2.0} and mc["max_position_embeddings"] == 256
    assert mc["tie_word_embeddings"] is False
    from msllm.models.llama.config import LlamaConfig
    LlamaConfig(seq_length=128, **mc)  # accepted as is by the msllm config
    side = json.loads((tmp_path / "out" / "llama.ckpt.json").read_text())
    assert side["format"] == "msllm-ckpt-v1" and side["size"] == out.stat().st_size
    assert side["model_config"]["intermediate_size"] == 37
    # nothing else (no temp files) left beside the output
    assert sorted(os.listdir(tmp_path / "out")) == ["llama.ckpt", "llama.ckpt.json"]


def test_cast_to_bf16_matches_torch_rounding_and_verifies(tmp_path):
    """--dtype bf16: every tensor equals torch's own fp32 -> bf16 rounding bit for bit."""
    import torch
    from safetensors.torch import load_file

    cfg_kw = CASES["mha_untied_ffn37_vocab32000"][0]
    model = make_random_hf_model(str(tmp_path / "hf"), seed=2, **cfg_kw)
    out = str(tmp_path / "m.ckpt")
    res = hf.convert_hf_to_msllm(str(tmp_path / "hf"), out, dtype="bf16", progress=False)
    ref = load_file(str(tmp_path / "hf" / "model.safetensors"))
    got = hf.read_msllm_tensors(out)
    for name, t in ref.items():
        data, dtype = got[hf.hf_to_msllm_name(name)]
        assert dtype == "bfloat16"
        np.testing.assert_array_equal(data, t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    report = check_parity(res.config, out, hf=model, round_to="bfloat16")
    assert report.max_abs_diff < 1e-4 and report.hf_next == report.msllm_next


@pytest.mark.parametrize("case", ["gemma_geglu_mqa", "qwen3_qknorm_head_dim"])
def test_cli_both_ways_with_verify_for_a_family(tmp_path, case):
    """convert_weight.py HF -> msllm --verify and --reversed --verify on Gemma / Qwen3: both pass,
    and the reversed directory names the family's architecture."""
    make_random_hf_model(str(tmp_path / "hf"), seed=13, **FAMILY_CASES[case])
    env = dict(os.environ, GLOG_v="3")
    out = tmp_path / "m.ckpt"
    r = subprocess.run([sys.executable, TOOL, "--torch_ckpt_dir", str(tmp_path / "hf"), "--mindspore_ckpt_path",
                        str(out), "--verify", "--no_progress"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "verify: PASSED" in r.stdout, r.stderr[-3000:]
    back = tmp_path / "back"
    r = subprocess.run([sys.executable, TOOL, "--reversed", "--mindspore_ckpt_path", str(out), "--torch_ckpt_dir",
                        str(back), "--verify", "--no_progress"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "verify: PASSED" in r.stdout, r.stderr[-3000:]
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == FAMILY_CASES[case]["model_type"]
    assert config["head_dim"] == FAMILY_CASES[case]["head_dim"]
