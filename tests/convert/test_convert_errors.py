"""Bad input to tools/convert_weight.py: one ``error:`` line naming the file / tensor / key, exit
code 2, no traceback and no output (not even a temporary file) in either direction."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from msllm.convert import hf
from msllm.training import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "convert_weight.py")

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16, "hidden_size": 8,
          "intermediate_size": 12, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def tensors(config=CONFIG):
    cfg = hf.hf_config_to_msllm(config)
    rng = np.random.default_rng(0)
    return {hf.msllm_to_hf_name(n): rng.standard_normal(s).astype(np.float32)
            for n, s in hf.param_shapes(cfg).items()}


def write_hf(directory, config=CONFIG, weights=None, config_text=None):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        fh.write(config_text if config_text is not None else json.dumps(config))
    save_file(weights if weights is not None else tensors(), os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def run(*args):
    return subprocess.run([sys.executable, TOOL, "--no_progress", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, GLOG_v="3"))


def assert_user_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)


def assert_refused(out_dir, args, needles, left=()):
    """The tool run with ``args`` (``out_dir`` made first if missing) fails with one user error
    naming every needle, and ``out_dir`` holds only ``left`` after it: no output, not even a
    temporary file."""
    out_dir.mkdir(exist_ok=True)
    assert_user_error(run(*args), *needles)
    assert sorted(os.listdir(out_dir)) == sorted(left)


def hf_case(tmp_path, name):
    """Build the broken HF directory for case ``name``; returns (dir, expected message parts)."""
    d = str(tmp_path / "hf")
    w = tensors()
    if name == "missing_config":
        write_hf(d)
        os.remove(os.path.join(d, "config.json"))
        return d, ["config.json", "not found"]
    if name == "malformed_config":
        return write_hf(d, config_text='{"model_type": "llama",'), ["config.json", "not valid JSON", "line 1"]
    if name == "unsupported_architecture":
        return write_hf(d, {**CONFIG, "architectures": ["MistralForCausalLM"]}), \
            ["config.json", "unsupported architecture", "MistralForCausalLM"]
    if name == "model_type_not_llama":
        return write_hf(d, {**CONFIG, "model_type": "gpt2"}), ["config.json", "model_type='gpt2'"]
    if name == "shape_mismatch":
        return write_hf(d, {**CONFIG, "intermediate_size": 10}), \
            ["model.safetensors", "tensor model.layers.0.mlp.gate_proj.weight has shape [12, 8]", "[10, 8]"]
    if name == "unknown_tensor":
        w["model.layers.0.mlp.extra_proj.weight"] = np.zeros((2, 2), np.float32)
        return write_hf(d, weights=w), ["model.safetensors", "unknown tensor model.layers.0.mlp.extra_proj.weight"]
    if name == "layer_beyond_config":
        w["model.layers.1.input_layernorm.weight"] = np.ones(8, np.float32)
        return write_hf(d, weights=w), ["unknown tensor model.layers.1.input_layernorm.weight", "num_layers=1"]
    if name == "missing_tensor":
        del w["model.layers.0.self_attn.v_proj.weight"]
        return write_hf(d, weights=w), ["missing", "model.layers.0.self_attn.v_proj.weight"]
    if name in ("missing_shard", "malformed_index", "index_points_to_wrong_shard"):
        write_hf(d)
        os.remove(os.path.join(d, "model.safetensors"))
        names = sorted(w)
        half = {n: w[n] for n in names[:5]}, {n: w[n] for n in names[5:]}
        files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        for part, f in zip(half, files):
            save_file(part, os.path.join(d, f), metadata={"format": "pt"})
        weight_map = {n: files[0] if n in half[0] else files[1] for n in names}
        index = os.path.join(d, "model.safetensors.index.json")
        if name == "malformed_index":
            open(index, "w").write("{\"weight_map\": ")
            return d, ["model.safetensors.index.json", "not valid JSON"]
        if name == "index_points_to_wrong_shard":
            weight_map[names[0]] = files[1]
        with open(index, "w") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh)
        if name == "missing_shard":
            os.remove(os.path.join(d, files[1]))
            return d, ["model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing"]
        return d, ["model.safetensors.index.json", f"tensor {names[0]}", files[1]]
    if name == "truncated_safetensors":
        write_hf(d)
        path = os.path.join(d, "model.safetensors")
        data = open(path, "rb").read()
        open(path, "wb").write(data[:-100])
        return d, ["model.safetensors", "run past the end of the file"]
    if name == "no_weights":
        os.makedirs(d)
        json.dump(CONFIG, open(os.path.join(d, "config.json"), "w"))
        return d, ["no weights found"]
    if name == "not_a_directory":
        return str(tmp_path / "nowhere"), ["nowhere", "not a directory"]
    # family features msllm does not implement: refused naming the key, never dropped
    if name == "gemma2_softcapping":
        return write_hf(d, {**CONFIG, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                            "attn_logit_softcapping": 50.0}), ["config.json", "attn_logit_softcapping=50.0"]
    if name == "qwen2_use_sliding_window":
        return write_hf(d, {**CONFIG, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                            "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}), \
            ["config.json", "use_sliding_window=True"]
    if name == "per_layer_attention_kinds":
        return write_hf(d, {**CONFIG, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                            "layer_types": ["sliding_attention"]}), ["config.json", "layer_types", "sliding_attention"]
    if name == "mlp_bias":
        return write_hf(d, {**CONFIG, "mlp_bias": True}), ["config.json", "mlp_bias=True"]
    if name == "unknown_rope_type":
        return write_hf(d, {**CONFIG, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}), \
            ["config.json", "rotary scaling 'longrope' is not implemented"]
    if name == "qwen2_missing_bias":
        qwen2 = {**CONFIG, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
        w = tensors(qwen2)
        del w["model.layers.0.self_attn.k_proj.bias"]
        return write_hf(d, qwen2, weights=w), ["missing", "model.layers.0.self_attn.k_proj.bias"]
    if name == "bias_for_a_llama_without_bias":
        w["model.layers.0.self_attn.q_proj.bias"] = np.zeros(8, np.float32)
        return write_hf(d, weights=w), ["unknown tensor model.layers.0.self_attn.q_proj.bias"]
    raise AssertionError(name)


HF_CASES = ["missing_config", "malformed_config", "unsupported_architecture", "model_type_not_llama",
            "shape_mismatch", "unknown_tensor", "layer_beyond_config", "missing_tensor", "missing_shard",
            "malformed_index", "index_points_to_wrong_shard", "truncated_safetensors", "no_weights",
            "not_a_directory", "gemma2_softcapping", "qwen2_use_sliding_window", "per_layer_attention_kinds",
            "mlp_bias", "unknown_rope_type", "qwen2_missing_bias", "bias_for_a_llama_without_bias"]


@pytest.mark.parametrize("case", HF_CASES)
def test_bad_hf_input_is_one_error_and_no_output(tmp_path, case):
    d, needles = hf_case(tmp_path, case)
    out_dir = tmp_path / "out"
    assert_refused(out_dir, ["--torch_ckpt_dir", d, "--mindspore_ckpt_path", str(out_dir / "m.ckpt")], needles)


def test_the_valid_base_case_converts(tmp_path):
    """The fixtures above are broken only where intended: the unbroken directory converts."""
    d = write_hf(str(tmp_path / "hf"))
    r = run("--torch_ckpt_dir", d, "--mindspore_ckpt_path", str(tmp_path / "m.ckpt"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m.ckpt").exists() and (tmp_path / "m.ckpt.json").exists()


def write_msllm(path, weights=None, sidecar=True, extra=None):
    cfg = hf.hf_config_to_msllm(CONFIG)
    w = weights if weights is not None else {hf.hf_to_msllm_name(n): v for n, v in tensors().items()}
    with hf.CkptWriter(path) as writer:
        for n, v in {**w, **(extra or {})}.items():
            writer.write(n, v, "float32" if v.dtype == np.float32 else "int32")
    if sidecar:
        ckpt.write_sidecar(path, cfg)
    return path


def reverse_case(tmp_path, name):
    p = str(tmp_path / "in.ckpt")
    w = {hf.hf_to_msllm_name(n): v for n, v in tensors().items()}
    if name == "no_manifest_no_config":
        return [write_msllm(p, sidecar=False)], ["in.ckpt has no manifest", "in.ckpt.json", "--config"]
    if name == "unknown_entry":
        return [write_msllm(p, extra={"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})], \
            ["in.ckpt", "unknown entry model.layers.0.mlp.extra.weight"]
    if name == "missing_weight":
        del w["model.norm.weight"]
        return [write_msllm(p, weights=w)], ["in.ckpt lacks 1 weight", "model.norm.weight"]
    if name == "shape_mismatch":
        w["lm_head.weight"] = np.zeros((15, 8), np.float32)
        return [write_msllm(p, weights=w)], ["in.ckpt", "weight lm_head.weight has shape [15, 8]", "[16, 8]"]
    if name == "not_a_checkpoint":
        open(p, "wb").write(b"\xff" * 64)
        ckpt.write_sidecar(p, hf.hf_config_to_msllm(CONFIG))
        return [p], ["in.ckpt", "not a MindSpore checkpoint"]
    if name == "missing_checkpoint":
        return [str(tmp_path / "absent.ckpt")], ["absent.ckpt", "not found"]
    if name == "truncated_per_manifest":
        write_msllm(p)
        data = open(p, "rb").read()
        open(p, "wb").write(data[:-10])
        return [p], ["in.ckpt does not match its manifest", "in.ckpt.json", "size"]
    if name == "corrupt_per_manifest":
        write_msllm(p)
        data = bytearray(open(p, "rb").read())
        data[-3] ^= 0xFF  # one flipped byte inside the last tensor
        open(p, "wb").write(bytes(data))
        return [p], ["in.ckpt does not match its manifest", "SHA-256"]
    if name == "config_disagrees_with_manifest":
        yml = tmp_path / "run.yaml"
        yml.write_text("model:\n  model_config:\n    vocab_size: 16\n    hidden_size: 8\n    num_layers: 2\n"
                       "    num_heads: 2\n    n_kv_heads: 1\n    intermediate_size: 12\n    seq_length: 32\n")
        return [write_msllm(p), "--config", str(yml)], ["run.yaml", "num_layers=2", "disagrees", "in.ckpt.json"]
    if name == "malformed_manifest":
        write_msllm(p)
        open(p + ".json", "w").write("{")
        return [p], ["in.ckpt.json", "unreadable"]
    raise AssertionError(name)


REVERSE_CASES = ["no_manifest_no_config", "unknown_entry", "missing_weight", "shape_mismatch", "not_a_checkpoint",
                 "missing_checkpoint", "truncated_per_manifest", "corrupt_per_manifest",
                 "config_disagrees_with_manifest",
                 "malformed_manifest"]


@pytest.mark.parametrize("case", REVERSE_CASES)
def test_bad_msllm_input_is_one_error_and_no_output(tmp_path, case):
    args, needles = reverse_case(tmp_path, case)
    parent = tmp_path / "exports"  # gets neither the output directory nor a temporary one
    assert_refused(parent, ["--reversed", "--mindspore_ckpt_path", *args[:1], "--torch_ckpt_dir", str(parent / "hf"),
                            *args[1:]], needles)


def test_reverse_refuses_a_non_empty_output_dir_and_accepts_config_yaml(tmp_path):
    p = write_msllm(str(tmp_path / "in.ckpt"), sidecar=False,
                    extra={"global_step": np.array([3], np.int32)})
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert_refused(busy, ["--reversed", "--mindspore_ckpt_path", p, "--torch_ckpt_dir", str(busy)],
                   ["busy", "not an empty directory"], left=["keep.txt"])
    yml = tmp_path / "run.yaml"
    yml.write_text("model:\n  model_config:\n    vocab_size: 16\n    hidden_size: 8\n    num_layers: 1\n"
                   "    num_heads: 2\n    n_kv_heads: 1\n    intermediate_size: 12\n    seq_length: 32\n"
                   "    rms_norm_eps: 1.0e-5\n")
    r = run("--reversed", "--mindspore_ckpt_path", p, "--torch_ckpt_dir", str(tmp_path / "ok"), "--config", str(yml))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "ok")) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["num_key_value_heads"] == 1


def test_failed_verification_publishes_nothing(tmp_path):
    """A before_publish failure (what --verify raises on a parity failure) removes the output."""
    from msllm.convert.verify import ParityError

    def fail(tmp, cfg):
        assert os.path.exists(tmp)
        raise ParityError("too far")

    d = write_hf(str(tmp_path / "hf"))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ParityError):
        hf.convert_hf_to_msllm(d, str(out / "m.ckpt"), progress=False, before_publish=fail)
    assert os.listdir(out) == []
    p = write_msllm(str(tmp_path / "in.ckpt"))
    with pytest.raises(ParityError):
        hf.convert_msllm_to_hf(p, str(out / "hf"), progress=False, before_publish=fail)
    assert os.listdir(out) == []


def test_tolerated_extras_are_skipped(tmp_path):
    """Old transformers saved rotary inv_freq buffers; tied models may still carry lm_head."""
    w = tensors({**CONFIG, "tie_word_embeddings": True})
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    w["lm_head.weight"] = np.ones((16, 8), np.float32)
    d = write_hf(str(tmp_path / "hf"), {**CONFIG, "tie_word_embeddings": True}, weights=w)
    hf.convert_hf_to_msllm(d, str(tmp_path / "m.ckpt"), progress=False)
    names = set(hf.scan_ckpt(str(tmp_path / "m.ckpt")))
    assert "lm_head.weight" not in names and not any("inv_freq" in n for n in names)
    assert len(names) == len(hf.param_shapes(hf.hf_config_to_msllm({**CONFIG, "tie_word_embeddings": True})))
