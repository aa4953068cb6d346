"""The kernels' thread pool is safe when two threads launch kernels at once (MindSpore 2.10 runs
CPU kernels one at a time today; a later version or another caller may not), and the statistics
call never writes past its buffer. The kernels are called directly through ctypes, which releases
the GIL, so the two launches really overlap."""

import ctypes
import os
import threading

import numpy as np

from msllm.kernels import build as kernel_build

N = 1 << 21          # 2 Mi floats: many 4096-element tasks per launch
ROUNDS = 40


def _lib():
    assert kernel_build.problem_with_build() is None, kernel_build.problem_with_build()
    return ctypes.CDLL(os.path.join(kernel_build.build_dir(), kernel_build.LIB_NAME))


def _swiglu(lib, g, u):
    """msllm_swiglu(g, u) -> silu(g) * u through the aot calling convention."""
    out = np.empty_like(g)
    arrays = [g, u, out]
    params = (ctypes.c_void_p * 3)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * 3)(1, 1, 1)
    shape = (ctypes.c_int64 * 1)(g.size)
    shapes = (ctypes.POINTER(ctypes.c_int64) * 3)(shape, shape, shape)
    dtypes = (ctypes.c_char_p * 3)(b"float32", b"float32", b"float32")
    rc = lib.msllm_swiglu(3, params, ndims, shapes, dtypes, None, None)
    assert rc == 0
    return out


def test_two_threads_launching_kernels_at_once_get_their_own_results():
    lib = _lib()
    rng = np.random.default_rng(5)
    print("seed 5")
    inputs = [(rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32))
              for _ in range(2)]
    refs = [_swiglu(lib, g, u) for g, u in inputs]           # one at a time
    for (g, u), ref in zip(inputs, refs):
        np.testing.assert_allclose(ref, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
    errors = []

    def worker(k):
        g, u = inputs[k]
        for _ in range(ROUNDS):
            if not np.array_equal(_swiglu(lib, g, u), refs[k]):
                errors.append(k)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a launch hung"
    assert errors == []


def test_kernel_stats_stay_inside_their_buffer():
    """With MSLLM_KERNEL_PROFILE=1 (read once per process: a fresh interpreter) the statistics text
    is cut at the buffer's size; nothing is written past it."""
    import subprocess
    import sys

    code = f"""
import ctypes, sys
import numpy as np
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from test_kernels_concurrency import _lib, _swiglu
lib = _lib()
g = np.ones(8192, np.float32)
_swiglu(lib, g, g)
full = lib.msllm_kernel_stats(None, 0, 0)
buf = ctypes.create_string_buffer(b"\\xAA" * 64, 64)
n = lib.msllm_kernel_stats(buf, 16, 0)
raw = buf.raw
print(full, n, raw[15], raw[16:] == b"\\xAA" * 48, raw[:15].decode())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MSLLM_KERNEL_PROFILE="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    full, n, last, untouched, head = r.stdout.split(maxsplit=4)
    assert int(full) > 16 and int(n) == int(full)      # the whole length is reported ...
    assert last == "0" and untouched == "True"         # ... but only 15 bytes + NUL were written
    assert head.startswith("msllm_swiglu")


def test_kernel_stats_from_python_count_the_calls_and_reset():
    """msllm.kernels.kernel_stats (benchmarks/decode_profile.py calls it between decode steps) reads the
    counters of the library the process loaded: three msllm_linear calls are three, with positive wall time;
    reset=True returns them and zeroes them; the library is opened once however often it is called."""
    import subprocess
    import sys

    code = f"""
import sys
import numpy as np
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from test_kernels_concurrency import _lib, _linear
import msllm.kernels as k
lib = _lib()
x = np.ones((1, 64), np.float32); w = np.ones((32, 64), np.float32)
for _ in range(3):
    _linear(lib, x, w)
first = k.kernel_stats(reset=True)
again = k.kernel_stats()
opened = k._loaded_library.cache_info().misses
print(first["msllm_linear"][0], first["msllm_linear"][1] > 0, again["msllm_linear"][0], opened)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MSLLM_KERNEL_PROFILE="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["3", "True", "0", "1"]


def _linear(lib, x, w):
    """msllm_linear: y = x W^T (W (out, in))."""
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    arrays = [x, w, y]
    params = (ctypes.c_void_p * 3)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * 3)(2, 2, 2)
    shapes = (ctypes.POINTER(ctypes.c_int64) * 3)(*[(ctypes.c_int64 * 2)(*a.shape) for a in arrays])
    dtypes = (ctypes.c_char_p * 3)(b"float32", b"float32", b"float32")
    assert lib.msllm_linear(3, params, ndims, shapes, dtypes, None, None) == 0
    return y


GEMM_CHECK = """
import sys
import numpy as np
sys.path.insert(0, {here!r})
from test_kernels_concurrency import _lib, _linear
from msllm.kernels import gemm_path
rng = np.random.default_rng(11)
worst = 0.0
for m, n, k in ((300, 1536, 576), (2048, 192, 576), (37, 4096, 130)):   # rows cut, columns cut, odd
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    y = _linear(_lib(), x, w)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    worst = max(worst, float(np.abs(y - ref).max() / np.abs(ref).max()))
print(gemm_path(), "|", worst)
"""


def test_the_gemm_slabs_fallback_and_the_interop_compute_the_same_products():
    """MSLLM_GEMM=slabs runs the fallback any other oneDNN version gets (fail closed: the interop's
    interface layout is 3.10's): both paths equal a float64 product to float32 rounding, and the
    start-up line names the path in use."""
    import subprocess
    import sys

    code = GEMM_CHECK.format(here=os.path.dirname(os.path.abspath(__file__)))
    seen = {}
    for mode in ("default", "slabs"):
        env = {k: v for k, v in os.environ.items() if k != "MSLLM_GEMM"}
        if mode == "slabs":
            env["MSLLM_GEMM"] = "slabs"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        path, worst = r.stdout.rsplit("|", 1)
        seen[mode] = path.strip()
        assert float(worst) < 1e-5, (mode, worst)
    assert seen["slabs"].startswith("GEMM slabs") and "MSLLM_GEMM=slabs" in seen["slabs"]
    assert seen["default"].endswith("threadpool GEMM") or "not the 3.10 interface" in seen["default"]
