"""Build msllm's CPU kernels: ``csrc/*.cc`` -> ``_build/libmsllm_kernels.so``.

    python -m msllm.kernels.build            # build if missing or stale (called by ``make install``)
    python -m msllm.kernels.build --force    # rebuild
    python -m msllm.kernels.build --check    # report whether a usable build exists; exit 2 if not

Needs only what pip and apt provide: ``g++`` 10 or newer (C++20 for ``std::atomic::wait``;
Debian/Ubuntu: ``apt-get install g++``) and the ``mindspore`` wheel, whose ``lib/libdnnl.so.3``
(oneDNN) supplies the GEMM; no MindSpore or oneDNN headers are needed (the one oneDNN function
used, ``dnnl_sgemm``, is declared in ``csrc/gemm.h``). The library is compiled for this
machine's CPU (``-march=native``; ``MSLLM_KERNELS_MARCH=haswell`` builds for AVX2 + FMA instead, see
:func:`msllm.kernels.toolchain.library_cxxflags`); ``_build/build_info.json`` records the source digest, the
compiler, the flags, the MindSpore version and the instruction sets the code was compiled for,
and :func:`msllm.kernels.library_path` refuses a build that is stale or made for another CPU.

Where: ``MSLLM_KERNELS_DIR`` if set, else ``msllm/kernels/_build`` next to this file. The output
is written under a temporary name and renamed, so an interrupted build leaves nothing half-made.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

from msllm.errors import MsllmError, cli_main
from msllm.fileio import exclusive_lock
from msllm.kernels.toolchain import (ISA_MACROS, MIN_GXX, build_dir, compiler, cpu_flags,  # noqa: F401
                                     library_cxxflags, library_march)

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
LIB_NAME = "libmsllm_kernels.so"
INFO_NAME = "build_info.json"


def sources() -> list[str]:
    """The library's C++ sources (``peak.cc`` is the clock probe's, built alone: :mod:`msllm.kernels.clock_probe`)."""
    return sorted(os.path.join(CSRC, f) for f in os.listdir(CSRC) if f.endswith((".cc", ".h")) and f != "peak.cc")


def source_digest() -> str:
    """SHA-256 over the C++ sources and the compiler flags (a change in either means rebuild)."""
    h = hashlib.sha256(" ".join(library_cxxflags()).encode())
    for path in sources():
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def mindspore_lib_dir() -> str:
    """``site-packages/mindspore/lib`` (found without importing mindspore), which must hold
    ``libdnnl.so.3``."""
    spec = importlib.util.find_spec("mindspore")
    if spec is None or not spec.origin:
        raise MsllmError("msllm kernels: the mindspore package is not installed in this Python")
    lib = os.path.join(os.path.dirname(spec.origin), "lib")
    if not os.path.exists(os.path.join(lib, "libdnnl.so.3")):
        raise MsllmError(f"msllm kernels: {lib}/libdnnl.so.3 (oneDNN, shipped in the mindspore wheel) "
                         "is missing; expected mindspore 2.10 for x86_64 Linux")
    return lib


def isa_of_build(cxx: str) -> list[str]:
    """The /proc/cpuinfo flags whose instruction sets the library's ``-march`` enables here."""
    out = subprocess.run([cxx, library_march(), "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                         text=True).stdout
    return sorted(flag for macro, flag in ISA_MACROS.items() if re.search(rf"#define {macro}\b", out))


def mindspore_version() -> str:
    try:
        return importlib.metadata.version("mindspore")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def read_info(directory: str | None = None) -> dict | None:
    path = os.path.join(directory or build_dir(), INFO_NAME)
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def problem_with_build(directory: str | None = None) -> str | None:
    """None if a usable library is built, else why not (one sentence, with the fix)."""
    d = directory or build_dir()
    lib, info = os.path.join(d, LIB_NAME), read_info(d)
    fix = "run `python -m msllm.kernels.build` (make install does)"
    if not os.path.exists(lib) or info is None:
        return f"msllm's CPU kernels are not built ({lib} missing): {fix}"
    if info.get("digest") != source_digest():
        built = next((f for f in info.get("flags", []) if f.startswith("-march=")), "other flags")
        if built != library_march():
            return (f"msllm's CPU kernels in {d} were built with {built}, this process "
                    f"asks for {library_march()} (MSLLM_KERNELS_MARCH={os.environ.get('MSLLM_KERNELS_MARCH', '')!r}): "
                    f"{fix} with the same setting, or set MSLLM_KERNELS_DIR to a directory of its own per setting")
        return f"msllm's CPU kernels in {d} were built from other sources or flags: {fix}"
    if info.get("mindspore") != mindspore_version():
        return (f"msllm's CPU kernels were built against mindspore {info.get('mindspore')}, "
                f"this is {mindspore_version()}: {fix}")
    missing = sorted(set(info.get("isa", [])) - cpu_flags())
    if missing:
        return (f"msllm's CPU kernels in {d} were compiled for a CPU with {', '.join(missing)}, "
                f"which this CPU lacks: {fix} on this machine")
    if not os.path.exists(os.path.join(info.get("mindspore_lib", ""), "libdnnl.so.3")):
        return f"msllm's CPU kernels link {info.get('mindspore_lib')}/libdnnl.so.3, which is gone: {fix}"
    return None


def build(force: bool = False, verbose: bool = True) -> str:
    """Compile the kernels if missing or stale; returns the library path. Raises MsllmError
    (no compiler, no oneDNN, a compile error) naming what to fix. One process at a time (a lock
    file in the build directory): two pytest-xdist workers (tests/run_parts.sh) that find the build
    stale compile it once, and never measure the clock probe at the same time (each would see half
    the CPU)."""
    d = build_dir()
    os.makedirs(d, exist_ok=True)
    with exclusive_lock(os.path.join(d, ".build.lock")):
        return _build(d, force, verbose)


def _build(d: str, force: bool, verbose: bool) -> str:
    from msllm.kernels.clock_probe import ensure_clock_probe

    # the clock behind the CPU peak (MFU / HFU), measured apart from the library: the peak must not
    # depend on whether the library builds or is used
    ensure_clock_probe(force=force, verbose=verbose)
    lib = os.path.join(d, LIB_NAME)
    if not force and problem_with_build(d) is None:
        if verbose:
            print(f"msllm kernels: up to date: {lib}")
        return lib
    cxx, _, version = compiler()
    ms_lib = mindspore_lib_dir()
    flags = library_cxxflags()
    with tempfile.TemporaryDirectory(prefix=".objects.", dir=d) as objects:
        tmp = os.path.join(objects, LIB_NAME)
        compile_and_link(cxx, flags, objects, tmp, [f"-L{ms_lib}", "-l:libdnnl.so.3", f"-Wl,-rpath,{ms_lib}"],
                         version, verbose)
        os.replace(tmp, lib)
    info = {"digest": source_digest(), "compiler": version, "flags": flags, "mindspore": mindspore_version(),
            "mindspore_lib": ms_lib, "isa": isa_of_build(cxx), "sources": [os.path.basename(s) for s in sources()]}
    fd, tmp = tempfile.mkstemp(prefix=".build_info.", suffix=".json", dir=d)
    with os.fdopen(fd, "w") as fh:
        json.dump(info, fh, indent=1)
    os.replace(tmp, os.path.join(d, INFO_NAME))
    if verbose:
        print(f"msllm kernels: built {lib} (instruction sets: {', '.join(info['isa']) or 'baseline'})")
    return lib


def compile_and_link(cxx: str, flags: list[str], objects: str, out: str, link: list[str], version: str,
                     verbose: bool) -> None:
    """Compile every ``csrc/*.cc`` to an object in ``objects``, as many at once as this process has CPUs (each
    file is its own translation unit either way: the library is the same as from one ``g++`` call, which took
    about twice as long on 2 cores), then link them into ``out``. Raises MsllmError with the compiler's
    message when a file does not compile or the link fails."""
    units = [s for s in sources() if s.endswith(".cc")]
    commands = [[cxx, *flags, "-c", "-I", CSRC, "-o", os.path.join(objects, os.path.basename(s) + ".o"), s]
                for s in units]
    linking = [cxx, *flags, "-o", out, *[c[c.index("-o") + 1] for c in commands], *link]
    if verbose:
        print(f"msllm kernels: {' '.join(commands[0][:-3])} OBJECT FILE.cc for each of {len(units)} files in {CSRC}, "
              f"then one link with {' '.join(link)}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        done = list(pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands))
    failed = [(c[-1], p) for c, p in zip(commands, done) if p.returncode != 0]
    if failed:
        raise MsllmError(f"msllm kernels: compiling {failed[0][0]} failed ({version}):\n{failed[0][1].stderr[-4000:]}")
    p = subprocess.run(linking, capture_output=True, text=True)
    if p.returncode != 0:
        raise MsllmError(f"msllm kernels: linking {out} failed ({version}):\n{p.stderr[-4000:]}")


@cli_main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build msllm's CPU kernels (msllm/kernels/csrc).")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--check", action="store_true", help="only report whether a usable build exists")
    a = p.parse_args(argv)
    if a.check:
        why = problem_with_build()
        if why:
            raise MsllmError(why)
        print(f"msllm kernels: usable build in {build_dir()}")
        return
    build(force=a.force)


if __name__ == "__main__":
    main(sys.argv[1:])
