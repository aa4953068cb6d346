"""The clock this machine's cores run vector FMAs at, measured once by a probe of its own.

``csrc/peak.cc`` (a register-only FMA loop, no loads or stores) is compiled alone, without
oneDNN or the rest of msllm's kernels, run on every core this process may use, and the result
written to ``<build dir>/clock_probe.json`` (:func:`msllm.kernels.toolchain.build_dir`); the
library is deleted after measuring. :func:`msllm.training.throughput.host_cpu_peak` derives
the CPU peak's clock from it, so the peak behind MFU and HFU is the same whether msllm's
kernels are built, disabled (``cpu_kernels: False``) or unusable (another oneDNN): it depends
only on whether a C++ compiler was there to measure the clock (``make install`` runs
``python -m msllm.kernels.build``, which runs this first). Without a measurement the CPU peak is
unknown and MFU is not reported (never a figure at the clock ``/proc/cpuinfo`` describes, which
in a KVM guest is the TSC rate, below the turbo clock the cores run at).

The record is used only on the CPU it was measured on (model name and instruction sets) and for
the sources and flags it was built with.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from typing import Optional

from msllm.errors import MsllmError

PROBE_INFO = "clock_probe.json"
PEAK_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "peak.cc")


def probe_digest() -> str:
    """SHA-256 of the probe's source and the compiler flags."""
    from msllm.kernels.toolchain import CXXFLAGS

    h = hashlib.sha256(" ".join(CXXFLAGS).encode())
    with open(PEAK_SOURCE, "rb") as fh:
        h.update(fh.read())
    return h.hexdigest()


def cpu_signature() -> str:
    """This CPU's vendor, family, model and model name (the first processor's ``/proc/cpuinfo``
    entries; a KVM guest's model name alone, "AMD EPYC", names several generations) and the vector
    instruction sets the probe may use."""
    from msllm.kernels.toolchain import ISA_MACROS, cpu_flags

    keys = ("vendor_id", "cpu family", "model", "model name")
    seen: dict = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in keys and key not in seen:
                    seen[key] = value.strip()
                if not line.strip() and seen:
                    break
    except OSError:
        pass
    return f"{' / '.join(seen.get(k, '?') for k in keys)} [{' '.join(sorted(set(ISA_MACROS.values()) & cpu_flags()))}]"


def read_clock_probe(directory: Optional[str] = None) -> Optional[dict]:
    """``{"threads", "lanes", "gflops"}`` measured on this CPU with the current probe, else None."""
    from msllm.kernels.toolchain import build_dir

    try:
        with open(os.path.join(directory or build_dir(), PROBE_INFO), encoding="utf-8") as fh:
            info = json.load(fh)
    except (OSError, ValueError):
        return None
    if info.get("digest") != probe_digest() or info.get("cpu") != cpu_signature():
        return None
    return info.get("fma_loop")


def measure_fma_loop(lib: str, threads: Optional[int] = None, repeats: int = 3, seconds: float = 0.3) -> dict:
    """What the FMA loop of library ``lib`` reaches on ``threads`` threads at once (default: every
    core of this process's affinity), best of ``repeats`` runs of about ``seconds`` each:
    ``{"threads", "lanes", "gflops"}``."""
    import ctypes

    so = ctypes.CDLL(lib)
    so.msllm_fma_gflops.restype, so.msllm_fma_gflops.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_double]
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    lanes = int(so.msllm_fma_lanes())
    best = max(so.msllm_fma_gflops(threads, seconds) for _ in range(repeats))
    return {"threads": threads, "lanes": lanes, "gflops": round(best, 3)}


def compile_probe(directory: str) -> str:
    """Compile ``csrc/peak.cc`` alone into ``directory``; returns the library's path.

    Raises:
        MsllmError: no C++ compiler, or the probe does not compile.
    """
    from msllm.kernels.toolchain import CXXFLAGS, compiler

    cxx, _, version = compiler()
    lib = os.path.join(directory, "libmsllm_clock_probe.so")
    p = subprocess.run([cxx, *CXXFLAGS, "-o", lib, PEAK_SOURCE], capture_output=True, text=True)
    if p.returncode != 0:
        raise MsllmError(f"msllm clock probe: compiling {PEAK_SOURCE} failed ({version}):\n{p.stderr[-2000:]}")
    return lib


def ensure_clock_probe(force: bool = False, verbose: bool = True) -> dict:
    """Measure the clock unless a current record exists; returns the ``fma_loop`` record.

    Raises:
        MsllmError: no C++ compiler (:func:`msllm.kernels.toolchain.compiler`), or the probe does not compile.
    """
    from msllm.kernels.toolchain import build_dir, compiler

    d = build_dir()
    have = None if force else read_clock_probe(d)
    if have is not None:
        return have
    version = compiler()[2]
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d, prefix=".clock_probe.") as tmp:
        loop = measure_fma_loop(compile_probe(tmp))
    info = {"digest": probe_digest(), "cpu": cpu_signature(), "compiler": version, "fma_loop": loop}
    fd, tmp = tempfile.mkstemp(prefix=".clock_probe.", suffix=".json", dir=d)
    with os.fdopen(fd, "w") as fh:
        json.dump(info, fh, indent=1)
    os.replace(tmp, os.path.join(d, PROBE_INFO))
    if verbose:
        print(f"msllm clock probe: FMA loop {loop['gflops']:.1f} GFLOP/s on {loop['threads']} core(s) "
              f"({loop['lanes']} lanes) -> {os.path.join(d, PROBE_INFO)}")
    return loop
