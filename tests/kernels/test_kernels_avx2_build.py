"""The kernels' AVX2 + FMA code (a CPU without AVX-512: AMD Zen 3, Intel before Skylake-SP), checked on any
AVX2 machine: the library built with ``MSLLM_KERNELS_MARCH=haswell`` (no AVX-512 instruction can be in it,
so every helper of ``csrc/vec.h`` compiles its 8-lane form, and the streaming linears pick AVX2 at run
time), then the operator test files run against that build in a child pytest: flash attention and its
gradients, RMSNorm, SwiGLU, rotary, cross-entropy, packed rows, the fused decode step and decode attention,
each against its own independent reference (numpy, float64, MindSpore's composed operators) as on the
native build. A library built with one ``-march`` is refused by a process asking for another."""

import json
import os
import re
import subprocess
import sys

import pytest

from msllm.kernels.toolchain import cpu_flags

HERE = os.path.dirname(os.path.abspath(__file__))
# the operator-level files; the AVX-512-only parametrizations are deselected (this build has no AVX-512)
CHILD_FILES = ["test_kernels_ops.py", "test_kernels_packed.py", "test_kernels_decode_fused.py"]
CHILD_DESELECT = "not avx512"


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """A directory holding the library built by ``python -m msllm.kernels.build`` with
    MSLLM_KERNELS_MARCH=haswell, and the environment that selects it."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.fail("this test needs a CPU with AVX2 and FMA (every machine msllm targets has them)")
    d = str(tmp_path_factory.mktemp("kernels_haswell"))
    env = dict(os.environ, MSLLM_KERNELS_MARCH="haswell", MSLLM_KERNELS_DIR=d)
    r = subprocess.run([sys.executable, "-m", "msllm.kernels.build"], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, env


def test_the_haswell_build_has_avx2_and_no_avx512(avx2_build):
    d, env = avx2_build
    with open(os.path.join(d, "build_info.json")) as fh:
        info = json.load(fh)
    assert "-march=haswell" in info["flags"]
    assert info["isa"] == ["avx", "avx2", "fma"]
    code = ("import ctypes; from msllm.kernels import library_path, vector_isa; "
            "lib = ctypes.CDLL(library_path()); print(vector_isa(), lib.msllm_gemv_isa(), lib.msllm_linear_int8_isa())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # vector helpers in 8 lanes; the float streaming linear on its AVX2 path (1) even on an AVX-512 CPU; the
    # int8 linear carries both of its paths in every build (GCC target attributes) and picks by the CPU's flags
    # (MSLLM_INT8_ISA=avx2 forces the AVX2 one, as benchmarks/llamacpp_speed.py --isa avx2 does)
    int8 = "2" if "avx512f" in cpu_flags() else "1"
    assert r.stdout.split() == ["AVX2+FMA", "1", int8]


def test_a_build_for_another_march_is_refused_by_name(avx2_build, monkeypatch):
    from msllm.kernels import build

    d, _ = avx2_build
    monkeypatch.delenv("MSLLM_KERNELS_MARCH", raising=False)
    why = build.problem_with_build(d)
    assert why is not None and "-march=haswell" in why and "-march=native" in why and "MSLLM_KERNELS_DIR" in why


def test_the_operator_tests_pass_on_the_avx2_build(avx2_build):
    """Every operator test of CHILD_FILES (dozens: shapes with 8- and 16-lane tails, sliding windows,
    GQA, ignored loss rows, |g| = 100 in SwiGLU, long caches in decode attention) on the AVX2 code."""
    _, env = avx2_build
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-k", CHILD_DESELECT,
           *[os.path.join(HERE, f) for f in CHILD_FILES]]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500, cwd=os.path.dirname(os.path.dirname(HERE)))
    tail = r.stdout[-4000:]
    assert r.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", tail).group(1))
    assert passed >= 90 and " failed" not in tail and "skipped" not in tail, tail


def test_a_march_that_is_not_one_word_is_one_clear_error(monkeypatch):
    from msllm.errors import MsllmError
    from msllm.kernels import build

    monkeypatch.setenv("MSLLM_KERNELS_MARCH", "haswell -O0")
    with pytest.raises(MsllmError, match="MSLLM_KERNELS_MARCH='haswell -O0': expected a GCC -march value"):
        build.problem_with_build()
