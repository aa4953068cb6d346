"""The build step and the fallback rules: a stale, foreign or missing build is refused with the
command that fixes it; what the model then runs is said, never silently changed."""

import dataclasses
import json
import os
import shutil

import pytest

from msllm.errors import MsllmError
from msllm.kernels import build, select
from msllm.models.llama.config import LlamaConfig


def small(**kw):
    return LlamaConfig(vocab_size=97, hidden_size=64, num_layers=1, num_heads=4, seq_length=16, **kw)


def with_keys(cfg, **keys):
    """``cfg`` with the kernel-selection fields set (LlamaConfig fields)."""
    return dataclasses.replace(cfg, **keys)


@pytest.fixture
def copied_build(kernels, tmp_path, monkeypatch):
    """A copy of the real build in a temporary MSLLM_KERNELS_DIR, to be damaged by the test."""
    for name in (build.LIB_NAME, build.INFO_NAME):
        shutil.copy(os.path.join(build.build_dir(), name), tmp_path / name)
    monkeypatch.setenv("MSLLM_KERNELS_DIR", str(tmp_path))
    assert build.problem_with_build() is None
    return tmp_path


def edit_info(d, **changes):
    info = json.loads((d / build.INFO_NAME).read_text())
    info.update(changes)
    (d / build.INFO_NAME).write_text(json.dumps(info))


def test_build_records_what_it_was_made_from(kernels):
    info = build.read_info()
    assert info["digest"] == build.source_digest()
    assert info["mindspore"] == build.mindspore_version()
    assert os.path.exists(os.path.join(info["mindspore_lib"], "libdnnl.so.3"))
    assert set(info["isa"]) <= build.cpu_flags()                 # compiled for this CPU


def test_stale_foreign_or_missing_builds_are_refused(copied_build):
    edit_info(copied_build, digest="0" * 64)
    assert "other sources or flags" in build.problem_with_build()
    edit_info(copied_build, digest=build.source_digest(), isa=["avx512f", "not_a_real_isa"])
    assert "not_a_real_isa" in build.problem_with_build()
    edit_info(copied_build, isa=[], mindspore="0.0.1")
    assert "mindspore 0.0.1" in build.problem_with_build()
    os.unlink(copied_build / build.LIB_NAME)
    why = build.problem_with_build()
    assert "not built" in why and "python -m msllm.kernels.build" in why


def test_missing_compiler_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setenv("MSLLM_KERNELS_DIR", str(tmp_path))
    with pytest.raises(MsllmError, match="no C\\+\\+ compiler 'no-such-compiler-xyz'.*apt-get install g\\+\\+"):
        build.build(verbose=False)
    assert os.listdir(tmp_path) in ([], [".build.lock"])          # nothing half-made (the lock is no build)


def test_a_file_that_does_not_compile_is_named_and_nothing_is_left(monkeypatch, tmp_path):
    """The files compile at the same time (one compiler per CPU), then link: a broken one is named in the
    error with the compiler's message, and the build directory holds no object file or half-made library."""
    from msllm.kernels import clock_probe

    src, out = tmp_path / "csrc", tmp_path / "build"
    src.mkdir()
    (src / "good.cc").write_text("int good() { return 1; }\n")
    (src / "broken.cc").write_text("int broken( { return 1; }\n")
    monkeypatch.setattr(build, "CSRC", str(src))
    monkeypatch.setattr(clock_probe, "ensure_clock_probe", lambda **kw: None)   # it builds csrc/peak.cc
    monkeypatch.setenv("MSLLM_KERNELS_DIR", str(out))
    with pytest.raises(MsllmError, match=r"(?s)compiling .*broken\.cc failed.*error"):
        build.build(verbose=False)
    assert os.listdir(out) == [".build.lock"]


def test_cpu_fast_path_selection(kernels, copied_build):
    cfg = small()
    chosen = select.choose(cfg, True, "CPU")
    assert chosen.cpu is not None and chosen.attention == select.CPU_FLASH and chosen.norm == select.CPU_NORM
    off = select.choose(with_keys(small(), use_flash_attention=False, fused_rms_norm=False), True, "CPU")
    assert off.cpu is not None and off.attention == off.norm == select.COMPOSED
    none = select.choose(with_keys(small(), cpu_kernels=False), True, "CPU")
    assert none.cpu is None and none.attention == none.norm == select.COMPOSED
    with pytest.raises(MsllmError, match="use_flash_attention: True on CPU needs msllm's CPU kernels"):
        select.choose(with_keys(small(), cpu_kernels=False, use_flash_attention=True), True, "CPU")
    fp16 = select.choose(small(compute_dtype="float16"), True, "CPU")
    assert fp16.cpu is None and "msllm's CPU kernels compute in float32" in fp16.describe()
    # compute_dtype bfloat16: the kernels with bf16-input GEMMs, the rest float32; or one clear error
    bf = select.choose(small(compute_dtype="bfloat16"), True, "CPU")
    assert bf.bf16_gemms and bf.cpu.gemm_dtype == "bfloat16" and bf.attention == select.CPU_FLASH
    assert "GEMM inputs rounded to bfloat16, float32 sums" in bf.describe() and not chosen.bf16_gemms
    for keys, message in (({"cpu_kernels": False}, "but cpu_kernels is False"),
                          ({"layernorm_compute_type": "bfloat16"}, "needs layernorm_compute_type"),
                          ({"param_init_type": "float16"}, "float32 or bfloat16 parameters")):
        with pytest.raises(MsllmError, match=message):
            select.choose(with_keys(small(compute_dtype="bfloat16"), **keys), True, "CPU")
    # bfloat16 weights build (inference); training refuses them earlier (tests/models/test_llama_bf16_compute.py)
    assert select.choose(with_keys(small(compute_dtype="bfloat16"), param_init_type="bfloat16"), True, "CPU").bf16_gemms
    # not built: the default falls back and says why; asking for the kernels is refused
    os.unlink(copied_build / build.LIB_NAME)
    fallback = select.choose(small(), True, "CPU")
    assert fallback.cpu is None and "python -m msllm.kernels.build" in fallback.describe()
    with pytest.raises(MsllmError, match="compute_dtype: bfloat16 on CPU runs on msllm's CPU kernels: "):
        select.choose(small(compute_dtype="bfloat16"), True, "CPU")
    with pytest.raises(MsllmError, match="cpu_kernels: True needs msllm's CPU kernels are not built"):
        select.choose(with_keys(small(), cpu_kernels=True), True, "CPU")
    with pytest.raises(MsllmError, match="must be|expected true, false or null"):
        select.choose(with_keys(small(), fused_rms_norm="yes"), True, "CPU")
