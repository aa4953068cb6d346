"""msllm's CPU kernels: fused operators for training on x86-64 CPUs, as MindSpore custom operators.

One C++ library (``csrc/``, built by ``python -m msllm.kernels.build``, which ``make install``
runs) provides, each with its gradient:

* ``linear``: the projections and the output head on oneDNN's sgemm (the libdnnl.so.3 inside the
  mindspore wheel), split over the cores; MindSpore 2.10's own CPU MatMul (nnacl) is level on
  some of the model's shapes and up to 1.9x slower on others (BENCHMARKS.md, micro_kernels);
* ``flash_attention``: causal (grouped-query) attention without the (B, H, T, T) score tensor,
  FlashAttention-2's algorithm with per-thread blocks;
* ``rms_norm`` / ``add_rms_norm``: RMSNorm in one pass, optionally fused with the residual add;
* ``swiglu`` and ``rope``: SwiGLU's silu(g) * u and the rotary embedding in one pass each.

The model selects them with its configuration (see ``msllm/models/llama/model.py``) and falls
back to MindSpore's composed operators when they are not built or not wanted. Design, numbers
and tolerances: docs/kernels.md.
"""

from __future__ import annotations

import functools
import os
import re

from msllm.errors import MsllmError


def unavailable_reason() -> str | None:
    """None if the kernels are built for this machine and this MindSpore, else why not (one
    sentence saying how to fix it)."""
    from msllm.kernels import build as _build  # imported here: ``python -m msllm.kernels.build`` runs it

    return _build.problem_with_build()


def available() -> bool:
    """True when :func:`library_path` would succeed."""
    return unavailable_reason() is None


# Every kernel switch of the environment: what it accepts besides unset or empty (the default), a tuple of
# values, or "int" (a non-negative integer) / "positive" (an integer >= 1), and the words an error gives after
# "expected" (the values and what they do). The C++ side reads them in csrc/switches.h (per kernel call) and
# csrc/stream.h (once per process); docs/kernels.md, "Switches", gives their defaults and the measurements
# behind them.
KERNEL_SWITCHES = {
    "MSLLM_GEMV_PREFETCH": ("int", "a non-negative integer (bytes ahead of their reads the weight-streaming "
                                   "products prefetch into L1; 0 = none)"),
    "MSLLM_GEMV_PREFETCH_FAR": ("int", "a non-negative integer (bytes ahead of their reads the weight-streaming "
                                       "products prefetch into L2; 0 = none)"),
    "MSLLM_GEMV_SPLIT": (("ranges", "chunks"), "'ranges' (each thread a contiguous share of a weight-streaming "
                                               "product's rows; the default) or 'chunks' (chunks handed out one "
                                               "by one)"),
    "MSLLM_GEMV_ROWS": (("2", "8"), "'2' or '8' (weight rows the streaming products read at once: AVX-512 at 1-2 "
                                    "rows of x, AVX2 at 1)"),
    "MSLLM_GEMV_MAX_ROWS": (("4", "8"), "'4' or '8' (rows of x up to which float32 weights are streamed, more on "
                                        "oneDNN)"),
    "MSLLM_GEMV_ISA": (("avx512", "avx2", "none"), "'avx512' (the widest the CPU has), 'avx2' or 'none' (oneDNN's "
                                                    "sgemm): the float32 / bfloat16 streaming path"),
    "MSLLM_NO_GEMV": (("1",), "'1' (no float32 / bfloat16 streaming path, as MSLLM_GEMV_ISA=none)"),
    "MSLLM_INT8_ISA": (("avx512", "avx2", "scalar"), "'avx512' (the widest the CPU has), 'avx2' or 'scalar' "
                                                      "(plain C++): the int8 streaming path"),
    "MSLLM_DECODE_ATTENTION": (("generic",), "'generic' (decode attention's generic loops for every head "
                                             "dimension) or nothing (its fixed-width loops where the head "
                                             "dimension has one)"),
    "MSLLM_GEMM_BF16": (("emulate",), "'emulate' (bfloat16 GEMMs as rounded copies and the float32 sgemm)"),
    "MSLLM_GEMM": (("slabs",), "'slabs' (the parallel sgemm cut into slabs instead of oneDNN's threadpool "
                               "interop)"),
    "MSLLM_KERNEL_THREADS": ("positive", "a positive integer (the kernels' thread count; unset: the CPUs this "
                                         "process may run on)"),
    "MSLLM_KERNEL_PROFILE": (("0", "1"), "'0' or '1' (1: time every kernel call, msllm_kernel_stats)"),
    "MSLLM_NO_HUGE_PAGES": (("1",), "'1' (leave streamed weights on the pages they have)"),
}


def check_environment() -> None:
    """Raises MsllmError naming the first kernel switch of the environment (:data:`KERNEL_SWITCHES`)
    whose value the library would not understand: ``NAME='value': expected ...`` with the values it
    takes and what they do. Unset or empty means the default (docs/kernels.md, "Switches")."""
    for name, (accepted, expected) in KERNEL_SWITCHES.items():
        v = os.environ.get(name, "")
        if not v:
            continue
        if accepted in ("int", "positive"):
            ok = re.fullmatch(r"[0-9]+", v) is not None and (accepted == "int" or int(v) >= 1)
        else:
            ok = v in accepted
        if not ok:
            raise MsllmError(f"{name}={v!r}: expected {expected}")


def library_path() -> str:
    """Absolute path of the built library; raises MsllmError saying how to build it, or naming a
    kernel setting of the environment it would not understand (:func:`check_environment`)."""
    from msllm.kernels import build as _build

    check_environment()
    why = unavailable_reason()
    if why:
        raise MsllmError(why)
    return os.path.join(_build.build_dir(), _build.LIB_NAME)


# numpy dtype name -> the dtype name MindSpore's AOT convention passes a kernel (csrc/aot.h); bfloat16 arrays
# (ml_dtypes' type, which MindSpore's asnumpy gives) or their bits as uint16
_AOT_DTYPES = {"float32": b"float32", "int32": b"int32", "int8": b"int8", "bfloat16": b"bfloat16", "uint16": b"bfloat16"}


def aot_args(arrays):
    """MindSpore's AOT kernel arguments (csrc/aot.h: nparam, params, ndims, shapes, dtypes, stream, extra) for
    the C-contiguous numpy ``arrays`` (inputs, then outputs): ((args), keep). ``keep`` holds the shape arrays the
    arguments point into: keep it (and ``arrays``) alive while the arguments are used. Built once, the arguments
    can be passed to the kernel any number of times, the arrays refilled in place in between (the generator's
    direct decode step, msllm/generation/direct_step.py; the kernel tests and benchmarks/gemv_prefetch.py).

    Raises MsllmError for an array of another dtype or not C-contiguous."""
    import ctypes

    for a in arrays:
        if a.dtype.name not in _AOT_DTYPES or not a.flags["C_CONTIGUOUS"]:
            raise MsllmError(f"aot_args: a {a.dtype.name} array (contiguous: {a.flags['C_CONTIGUOUS']}); expected a "
                             f"C-contiguous array of {', '.join(sorted(_AOT_DTYPES))}")
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    keep = [(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in keep])
    dtypes = (ctypes.c_char_p * n)(*[_AOT_DTYPES[a.dtype.name] for a in arrays])
    return (n, params, ndims, shapes, dtypes, None, None), keep


def cpu_kernels(gemm_dtype: str = "float32"):
    """The MindSpore operators (:class:`msllm.kernels.ops.CpuKernels`) of the built library;
    ``gemm_dtype`` ``"bfloat16"``: the linear layers' GEMMs take bfloat16-rounded inputs."""
    from msllm.kernels.ops import cpu_kernels as _make

    return _make(library_path(), gemm_dtype)


@functools.lru_cache(maxsize=1)
def _loaded_library():
    """The built library through ctypes: the handle of the one MindSpore loaded (same counters).
    Opened once per process: :func:`library_path` re-checks the build (the sources' digest, MindSpore's
    version) at every call (about 3 ms warm), which benchmarks/decode_profile.py paid twice between every two
    decode steps through :func:`kernel_stats` (the second core idle meanwhile, so the next step started slower)
    and the start-up line three times (:func:`gemm_path`, :func:`vector_isa`, :func:`gemm_bf16_native`).
    Raises MsllmError as :func:`library_path` does (not cached: the next call checks again)."""
    import ctypes

    return ctypes.CDLL(library_path())


def gemm_bf16_native() -> bool:
    """True when oneDNN runs bfloat16-input GEMMs with this CPU's bfloat16 arithmetic (AMX-BF16,
    AVX512_BF16, AVX2-VNNI-2); False when msllm emulates them (rounded inputs, float32 sgemm: the
    same results up to summation order, slower than float32). ``csrc/gemm_bf16.cc``."""
    return bool(_loaded_library().msllm_gemm_bf16_native())


def vector_isa() -> str:
    """The instruction set the library's own vector code (softmax, norms, SwiGLU, loss, attention's
    dot products; ``csrc/vec.h``) was compiled for: ``"AVX-512F"``, ``"AVX2+FMA"`` or ``"plain C++"``.
    Set when the library is built (``-march=native``, or ``MSLLM_KERNELS_MARCH``); the weight-streaming
    and int8 linears choose AVX-512 or AVX2 again at run time from the CPU's flags."""
    return {2: "AVX-512F", 1: "AVX2+FMA"}.get(_loaded_library().msllm_vector_isa(), "plain C++")


def kernel_stats(reset: bool = False) -> dict:
    """Calls and wall seconds per kernel since the start (or the last reset), recorded only when
    the process runs with ``MSLLM_KERNEL_PROFILE=1``: ``{"msllm_linear": (calls, seconds), ...}``."""
    import ctypes

    lib = _loaded_library()
    buf = ctypes.create_string_buffer(1 << 16)
    n = lib.msllm_kernel_stats(buf, len(buf), int(reset))
    out = {}
    for line in buf.value[:n].decode().splitlines():
        name, calls, nanos = line.split()
        out[name] = (int(calls), int(nanos) / 1e9)
    return out


def gemm_path() -> str:
    """The parallel GEMM the kernels run, for the start-up line: oneDNN 3.10's threadpool interop,
    or the "slabs" fallback (row or column slabs, one single-threaded sgemm each) when the oneDNN
    that MindSpore ships is another version (the interop's hand-copied interface layout is 3.10's:
    a mismatch fails closed to slabs) or ``MSLLM_GEMM=slabs`` is set."""
    import ctypes

    lib = _loaded_library()
    major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    interop = lib.msllm_gemm_interop(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
    found = f"oneDNN {major.value}.{minor.value}.{patch.value}"
    if interop:
        return f"{found} threadpool GEMM"
    why = "MSLLM_GEMM=slabs" if os.environ.get("MSLLM_GEMM") == "slabs" else "not the 3.10 interface msllm copies"
    return f"GEMM slabs ({found}: {why})"


__all__ = ["available", "unavailable_reason", "library_path", "aot_args", "cpu_kernels", "kernel_stats", "gemm_path",
           "gemm_bf16_native", "vector_isa"]
