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


def check_environment() -> None:
    """Raises MsllmError naming a kernel setting of the environment that the library would not
    understand: ``MSLLM_GEMV_PREFETCH`` and ``MSLLM_GEMV_PREFETCH_FAR`` (bytes ahead of their reads the
    weight-streaming products prefetch into L1 and into L2; 0 = none; unset = 8192 and 32768,
    ``stream_prefetch`` in csrc/common.h) must be non-negative integers; ``MSLLM_DECODE_ATTENTION``
    (``generic``: decode attention's generic loops for every head dimension instead of its fixed-width
    ones, csrc/decode.cc ``head_kernels``) must be unset, empty or ``generic``; ``MSLLM_GEMV_SPLIT``
    (how the weight-streaming products split their rows between the threads, csrc/common.h
    ``for_row_chunks``) must be unset, empty, ``ranges`` or ``chunks``."""
    for name, what, unset in (("MSLLM_GEMV_PREFETCH", "into L1", 8192),
                              ("MSLLM_GEMV_PREFETCH_FAR", "into L2", 32768)):
        v = os.environ.get(name, "")
        if v and not re.fullmatch(r"[0-9]+", v):
            raise MsllmError(f"{name}={v!r}: expected a non-negative integer (bytes ahead of their reads the "
                             f"weight-streaming products prefetch {what}; 0 = none; unset: {unset})")
    v = os.environ.get("MSLLM_DECODE_ATTENTION", "")
    if v not in ("", "generic"):
        raise MsllmError(f"MSLLM_DECODE_ATTENTION={v!r}: expected 'generic' (decode attention's generic loops for "
                         "every head dimension) or nothing (its fixed-width loops where the head dimension has one)")
    v = os.environ.get("MSLLM_GEMV_SPLIT", "")
    if v not in ("", "ranges", "chunks"):
        raise MsllmError(f"MSLLM_GEMV_SPLIT={v!r}: expected 'ranges' (each thread a contiguous share of a weight-"
                         "streaming product's rows; the default) or 'chunks' (chunks handed out one by one)")


def library_path() -> str:
    """Absolute path of the built library; raises MsllmError saying how to build it, or naming a
    kernel setting of the environment it would not understand (:func:`check_environment`)."""
    from msllm.kernels import build as _build

    check_environment()
    why = unavailable_reason()
    if why:
        raise MsllmError(why)
    return os.path.join(_build.build_dir(), _build.LIB_NAME)


def cpu_kernels(gemm_dtype: str = "float32"):
    """The MindSpore operators (:class:`msllm.kernels.ops.CpuKernels`) of the built library;
    ``gemm_dtype`` ``"bfloat16"``: the linear layers' GEMMs take bfloat16-rounded inputs."""
    from msllm.kernels.ops import cpu_kernels as _make

    return _make(library_path(), gemm_dtype)


def gemm_bf16_native() -> bool:
    """True when oneDNN runs bfloat16-input GEMMs with this CPU's bfloat16 arithmetic (AMX-BF16,
    AVX512_BF16, AVX2-VNNI-2); False when msllm emulates them (rounded inputs, float32 sgemm: the
    same results up to summation order, slower than float32). ``csrc/gemm_bf16.cc``."""
    import ctypes

    return bool(ctypes.CDLL(library_path()).msllm_gemm_bf16_native())


def vector_isa() -> str:
    """The instruction set the library's own vector code (softmax, norms, SwiGLU, loss, attention's
    dot products; ``csrc/common.h``) was compiled for: ``"AVX-512F"``, ``"AVX2+FMA"`` or ``"plain C++"``.
    Set when the library is built (``-march=native``, or ``MSLLM_KERNELS_MARCH``); the weight-streaming
    and int8 linears choose AVX-512 or AVX2 again at run time from the CPU's flags."""
    import ctypes

    return {2: "AVX-512F", 1: "AVX2+FMA"}.get(ctypes.CDLL(library_path()).msllm_vector_isa(), "plain C++")


def kernel_stats(reset: bool = False) -> dict:
    """Calls and wall seconds per kernel since the start (or the last reset), recorded only when
    the process runs with ``MSLLM_KERNEL_PROFILE=1``: ``{"msllm_linear": (calls, seconds), ...}``."""
    import ctypes

    lib = ctypes.CDLL(library_path())  # the library MindSpore loaded: same handle, same counters
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

    lib = ctypes.CDLL(library_path())
    major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    interop = lib.msllm_gemm_interop(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
    found = f"oneDNN {major.value}.{minor.value}.{patch.value}"
    if interop:
        return f"{found} threadpool GEMM"
    why = "MSLLM_GEMM=slabs" if os.environ.get("MSLLM_GEMM") == "slabs" else "not the 3.10 interface msllm copies"
    return f"GEMM slabs ({found}: {why})"


__all__ = ["available", "unavailable_reason", "library_path", "cpu_kernels", "kernel_stats", "gemm_path",
           "gemm_bf16_native", "vector_isa"]
