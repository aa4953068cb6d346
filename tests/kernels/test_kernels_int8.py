"""Weight-only int8: the quantization rule (msllm/models/llama/quantization.py) and the ``linear_int8``
kernel (msllm/kernels/csrc/linear_int8.cc) against a numpy float64 reference of the dequantised
weights' matmul, on every path: 1-8 rows streamed (AVX-512, AVX2, plain C++, chosen with
``MSLLM_INT8_ISA``), more rows through dequantised slabs and the sgemm; and the AVX2 routine compiled
as on an AVX2-only machine (``-march=haswell``: no AVX-512 instruction can be in it) giving the same
numbers as the AVX-512 one.

Reference: ``x @ (q * s)^T`` in float64 with q, s from :func:`quantize_rows`, whose rule is checked
on a hand-worked example. Tolerance as the other kernels' (tests/kernels/test_kernels_ops.py):
max |diff| <= 1e-5 x max |reference| + 1e-6 (float32 sums of up to 1000 products).
"""

import ctypes
import os
import subprocess

import numpy as np
import pytest
from kerneltest_helpers import close, seeded_rng

from mindspore import Tensor

from msllm.models.llama.quantization import dequantize, quantize_rows

SEED = 20261127
RTOL = 1e-5


def rng():
    return seeded_rng(SEED)


def test_quantize_rows_follows_the_rtn_rule_on_a_hand_worked_example():
    w = np.array([[0.5, -1.27, 0.01, 0.0],       # max 1.27 -> s = 0.01: q = 50, -127, 1, 0
                  [0.0, 0.0, 0.0, 0.0],          # all zero -> s = 0, q = 0
                  [0.31, 0.2, -0.6, 0.45]], np.float32)   # s = 0.6/127
    q, s, g = quantize_rows(w)
    assert g == 4 and s.shape == (3, 1) and q.dtype == np.int8
    np.testing.assert_allclose(s[:, 0], [0.01, 0.0, 0.6 / 127], rtol=1e-7)
    np.testing.assert_array_equal(q[0], [50, -127, 1, 0])
    np.testing.assert_array_equal(q[1], [0, 0, 0, 0])
    np.testing.assert_array_equal(q[2], [66, 42, -127, 95])   # 65.62, 42.33, -127, 95.25 rounded
    # per group of 2 inputs (the last group of a 5-wide row holds one input)
    q, s, g = quantize_rows(np.array([[1.0, -0.52, 0.02, 0.011, -3.0]]), 2)
    assert g == 2 and s.shape == (1, 3)
    np.testing.assert_allclose(s[0], [1 / 127, 0.02 / 127, 3 / 127], rtol=1e-7)
    np.testing.assert_array_equal(q[0], [127, -66, 127, 70, -127])   # -66.04, 69.85 rounded


@pytest.mark.parametrize("group", [0, 32])
def test_quantization_error_is_at_most_half_a_step(group):
    w = rng().standard_normal((40, 96)).astype(np.float32)
    q, s, g = quantize_rows(w, group)
    step = np.repeat(s.astype(np.float64), g, axis=1)[:, :96]
    assert np.all(np.abs(dequantize(q, s, g) - w) <= step / 2 * (1 + 1e-6))
    assert np.abs(q).max() == 127


def problem(m, n_in, out, group, seed_offset=0):
    r = np.random.default_rng(SEED + seed_offset)
    x = r.standard_normal((m, n_in)).astype(np.float32)
    w = (r.standard_normal((out, n_in)) * np.exp(r.standard_normal((out, 1)))).astype(np.float32)  # rows of any scale
    q, s, g = quantize_rows(w, group)
    return x, q, s, g, x.astype(np.float64) @ dequantize(q, s, g).T


# rows: each streamed count (1-8) and the slab path (9, 40); inputs: a multiple of 16, 576 (SmolLM2's
# hidden size: groups of 128 leave a last group of 64), 100 (a 4-input tail after the last full vector)
CASES = [(m, n_in, group) for m in (1, 2, 3, 4, 5, 8, 9, 40) for n_in, group in ((64, 0), (576, 128), (100, 0))] + [
    (1, 100, 32), (7, 100, 32), (3, 1000, 64)]


@pytest.mark.parametrize("m,n_in,group", CASES)
def test_linear_int8_equals_the_float64_dequantised_matmul(kernels, pynative, m, n_in, group):
    print("seed", SEED)
    x, q, s, g, ref = problem(m, n_in, 37, group)   # 37 output rows: an odd last row per chunk
    got = kernels.linear_int8(Tensor(x), Tensor(q), Tensor(s), kernels.group_tensor(g)).asnumpy()
    close(got, ref)


def test_linear_int8_takes_leading_dimensions(kernels, pynative):
    x, q, s, g, ref = problem(6, 64, 20, 16)
    got = kernels.linear_int8(Tensor(x.reshape(2, 3, 64)), Tensor(q), Tensor(s), kernels.group_tensor(g)).asnumpy()
    close(got, ref.reshape(2, 3, 20))


# ---- the instruction-set paths, called directly (ctypes, MindSpore's AOT signature) -----------------
def call_aot(lib, x, q, s, g):
    """msllm_linear_int8 of the library ``lib`` on numpy arrays: (return code, y)."""
    y = np.zeros((x.shape[0], q.shape[0]), np.float32)
    grp = np.array([g], np.float32)
    arrays = [np.ascontiguousarray(a) for a in (x, q, s, grp)] + [y]
    params = (ctypes.c_void_p * 5)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * 5)(*[a.ndim for a in arrays])
    shapes_keep = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * 5)(*[ctypes.cast(sh, ctypes.POINTER(ctypes.c_int64)) for sh in shapes_keep])
    names = [b"float32", b"int8", b"float32", b"float32", b"float32"]
    dtypes = (ctypes.c_char_p * 5)(*names)
    rc = lib.msllm_linear_int8(5, params, ndims, shapes, dtypes, None, None)
    return rc, y


@pytest.fixture
def isa_env():
    old = os.environ.get("MSLLM_INT8_ISA")
    yield
    if old is None:
        os.environ.pop("MSLLM_INT8_ISA", None)
    else:
        os.environ["MSLLM_INT8_ISA"] = old


def cpu_has(flag):
    from msllm.kernels.toolchain import cpu_flags

    return flag in cpu_flags()


@pytest.mark.parametrize("m", [1, 4, 5, 8])
def test_each_instruction_set_path_gives_the_reference(kernels, isa_env, m):
    from msllm.kernels import library_path

    lib = ctypes.CDLL(library_path())
    paths = {"scalar": 0}
    if cpu_has("avx2") and cpu_has("fma"):
        paths["avx2"] = 1
    if cpu_has("avx512f"):
        paths["avx512"] = 2
    print("paths on this CPU:", sorted(paths))
    # groups of 128 with a short last one; per channel with a 4-input tail; groups of 32 with a tail
    for n_in, group in ((576, 128), (100, 0), (100, 32)):
        x, q, s, g, ref = problem(m, n_in, 45, group, seed_offset=m)
        for name, code in paths.items():
            os.environ["MSLLM_INT8_ISA"] = name
            assert lib.msllm_linear_int8_isa() == code
            rc, y = call_aot(lib, x, q, s, g)
            assert rc == 0
            close(y, ref)
    os.environ.pop("MSLLM_INT8_ISA")
    assert lib.msllm_linear_int8_isa() == max(paths.values())   # unforced: the widest the CPU has
    # bad input is refused with a code, not read out of bounds: a group size that does not give G scales
    assert call_aot(lib, x, q, s, 64)[0] == 2


def test_avx2_build_without_avx512_gives_the_same_numbers(kernels, isa_env, tmp_path):
    """The int8 routine compiled as an AVX2-only machine compiles it (-march=haswell: AVX2 + FMA, no
    AVX-512 macros or instructions outside the target-attributed AVX-512 variant, which it does not run
    here), called on the AVX2 path: the reference, and the AVX-512 path's numbers to float32 rounding."""
    if not (cpu_has("avx2") and cpu_has("fma")):
        pytest.fail("this test needs a CPU with AVX2 and FMA (every machine msllm targets has them)")
    from msllm.kernels import build, library_path
    from msllm.kernels.toolchain import CXXFLAGS, compiler

    cxx = compiler()[0]
    flags = [f for f in CXXFLAGS if not f.startswith("-march=")] + ["-march=haswell"]
    out = tmp_path / "libint8_avx2.so"
    ms_lib = build.mindspore_lib_dir()
    cmd = [cxx, *flags, "-I", build.CSRC, "-o", str(out), os.path.join(build.CSRC, "linear_int8.cc"),
           f"-L{ms_lib}", "-l:libdnnl.so.3", f"-Wl,-rpath,{ms_lib}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    macros = subprocess.run([cxx, "-march=haswell", "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                            text=True).stdout
    assert "__AVX2__" in macros and "__AVX512F__" not in macros
    avx2 = ctypes.CDLL(str(out))
    native = ctypes.CDLL(library_path())
    for m in (1, 3, 8):
        x, q, s, g, ref = problem(m, 576, 50, 128 if m != 3 else 0, seed_offset=10 + m)
        os.environ["MSLLM_INT8_ISA"] = "avx2"
        assert avx2.msllm_linear_int8_isa() == 1
        rc, y2 = call_aot(avx2, x, q, s, g)
        assert rc == 0
        close(y2, ref)
        os.environ.pop("MSLLM_INT8_ISA")
        rc, yn = call_aot(native, x, q, s, g)
        assert rc == 0
        close(yn, ref)
        # same dequantised weights, float32 sums in another lane order: equal to a few float32 ulps
        np.testing.assert_allclose(y2, yn, rtol=0, atol=2e-6 * np.abs(ref).max())
