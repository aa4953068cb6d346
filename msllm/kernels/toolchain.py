"""The C++ toolchain and build location shared by msllm's kernel library
(:mod:`msllm.kernels.build`) and its clock probe (:mod:`msllm.kernels.clock_probe`): compiler
flags, the compiler, the build directory, this CPU's flags."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from msllm.errors import MsllmError

HERE = os.path.dirname(os.path.abspath(__file__))
# the clock probe's flags, and the library's unless MSLLM_KERNELS_MARCH names another target (library_cxxflags)
CXXFLAGS = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-pthread", "-fno-math-errno",
            "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"]
# instruction-set macros recorded at build time and checked against /proc/cpuinfo at load time
ISA_MACROS = {"__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq",
              "__AVX512VL__": "avx512vl", "__AVX2__": "avx2", "__FMA__": "fma", "__AVX__": "avx"}
MIN_GXX = 10


def library_march() -> str:
    """The kernel library's ``-march=`` flag: from the environment variable ``MSLLM_KERNELS_MARCH`` when set
    (a GCC ``-march`` value: ``haswell`` or ``x86-64-v3`` = AVX2 + FMA without AVX-512, for a library that also
    runs on AMD Zen 3 or older Intel cores, or to measure the AVX2 code on an AVX-512 machine), else
    ``-march=native``. Raises MsllmError for a value that is not a plain -march word."""
    march = os.environ.get("MSLLM_KERNELS_MARCH", "").strip()
    if not march:
        return "-march=native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", march):
        raise MsllmError(f"MSLLM_KERNELS_MARCH={march!r}: expected a GCC -march value such as haswell or x86-64-v3")
    return f"-march={march}"


def library_cxxflags() -> list[str]:
    """The kernel library's compiler flags: :data:`CXXFLAGS` with :func:`library_march`. The flags are part of
    the build's digest, so a library built with one ``-march`` is refused (by name) by a process asking for
    another."""
    march = library_march()
    return [march if f.startswith("-march=") else f for f in CXXFLAGS]


def build_dir() -> str:
    """Directory holding the built library and its build_info.json."""
    return os.environ.get("MSLLM_KERNELS_DIR") or os.path.join(HERE, "_build")


def compiler() -> tuple[str, int, str]:
    """(path, major version, version line) of the C++ compiler (``CXX`` or ``g++``)."""
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise MsllmError(f"msllm kernels: no C++ compiler {cxx!r} on PATH; install g++ >= {MIN_GXX} "
                         "(Debian/Ubuntu: apt-get install g++) or set CXX")
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    first = out.splitlines()[0] if out else cxx
    m = re.search(r"(\d+)\.\d+", first)
    major = int(m.group(1)) if m else 0
    if "clang" not in first and major < MIN_GXX:
        raise MsllmError(f"msllm kernels: {path} is {first!r}; g++ >= {MIN_GXX} is needed (C++20)")
    return path, major, first


def cpu_flags() -> set[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty when unreadable)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
