"""The device layer of MindSpore's dry-run: a real CANN when there is one, else a stub tree.

MindSpore 2.10's simulation (docs: mindspore-ai/docs ``tutorials/source_en/debug/dryrun.md``)
compiles the graph of one rank of an N-rank job in one process, without a device, when
``MS_SIMULATION_LEVEL`` (0: compile; 1: compile and count each operator's device memory, printed
at exit as ``Used peak memory usage (without fragments): ...M``), ``RANK_SIZE`` and ``RANK_ID`` are
set and ``device_target`` is ``Ascend``. It still has to load MindSpore's Ascend plugin, which
links against CANN. Facts measured on this project's machines (MindSpore 2.10.0, x86-64, no
Ascend device, no CANN):

* the plugin loads once libraries under CANN's names export every symbol it needs; then
  ``init()`` logs ``This is simulation mode with level N`` and ``Initializing dummy collective
  communication`` and creates its communication groups with the real rank lists;
* MindSpore derives the CANN root from a library path containing ``latest``
  (``<root>/latest/lib64``, driver libraries in ``lib64/driver``), found through
  ``LD_LIBRARY_PATH`` and ``ASCEND_HOME_PATH``; ``init()`` imports a Python package ``hccl``
  and reads ``hccl.sys_version.__sys_version__``;
* levels 2 and 3 need a device (``The pointer[default_stream_] is null``): msllm offers 0 and 1.

:func:`device_layer` returns a real CANN (``ASCEND_HOME_PATH``, then the usual install paths) or
builds the stub tree once into ``$MSLLM_CACHE/cann_stub/<key>`` (default ``~/.cache/msllm``), keyed
by the MindSpore version and a digest of its plugin libraries, from the symbol tables of the
installed wheel (:mod:`msllm.cluster.stub_symbols`, :mod:`msllm.cluster.stub_source`). The stubs
return 0 or an empty object and are never executed for compute: at levels 0/1 nothing is
launched, so no number comes out of the graph (docs/dryrun.md). :func:`simulation_env` is the
environment a compile child process needs (``LD_LIBRARY_PATH`` is read by the dynamic loader at
process start, which is why the compile always runs in a child).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from msllm.errors import MsllmError

log = logging.getLogger("msllm")

TESTED_MINDSPORE = ("2.10.0",)  # the versions the stub layer was built and checked against
SIM_LEVELS = (0, 1)
HCCL_VERSION = "8.3.RC1"  # what the stub ``hccl`` package reports (a CANN 8.3 release name)
_CANN_PATHS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/latest",
               "/usr/local/Ascend/cann/latest")
_STUB_FORMAT = "3"  # bump when stub_source's output changes, so old trees are rebuilt


@dataclass(frozen=True)
class DeviceLayer:
    """What the compile child links against.

    root: the CANN root (``.../latest``) holding ``lib64``.
    stub: True for msllm's stub tree (compile-only simulation), False for a real CANN.
    python_path: a directory to put on ``PYTHONPATH`` (the stub ``hccl`` package) or ``None``.
    """

    root: str
    stub: bool
    python_path: str | None = None

    def describe(self) -> str:
        if self.stub:
            return (f"dry-run device layer: msllm's stub CANN tree at {self.root} (compile-only simulation: "
                    "no Ascend device and no CANN here; the stubs return 0 and run no kernel)")
        return f"dry-run device layer: CANN at {self.root}"


def mindspore_dir() -> tuple[str, str]:
    """``(version, package directory)`` of the installed MindSpore, without importing it (its
    import takes seconds and would load the CPU backend into the parent)."""
    from importlib import metadata, util

    spec = util.find_spec("mindspore")
    if spec is None or not spec.submodule_search_locations:
        raise MsllmError("the dry-run needs MindSpore installed (pip install mindspore==2.10.0)")
    return metadata.version("mindspore"), list(spec.submodule_search_locations)[0]


def check_version(version: str) -> None:
    """Refuse a MindSpore the stub layer was not tested with (one message, before any build)."""
    if version not in TESTED_MINDSPORE:
        raise MsllmError(f"the dry-run (--sim_level) was tested with MindSpore {', '.join(TESTED_MINDSPORE)}; "
                         f"this is MindSpore {version}: its Ascend plugin may need other CANN functions "
                         "than the stub layer provides. Install mindspore==2.10.0 for the dry-run")


def cache_root() -> str:
    """``$MSLLM_CACHE`` if set, else ``~/.cache/msllm`` (as :mod:`msllm.convert.real_model`)."""
    return os.environ.get("MSLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "msllm")


def find_cann() -> str | None:
    """A real CANN root: ``ASCEND_HOME_PATH``, else the usual install paths; one that holds
    ``lib64/libascendcl.so`` and is not msllm's own stub tree. ``None`` when there is none."""
    cands = [os.environ.get("ASCEND_HOME_PATH", "")] + list(_CANN_PATHS)
    for c in cands:
        if c and os.path.isfile(os.path.join(c, "lib64", "libascendcl.so")) and \
                not os.path.exists(os.path.join(c, "MSLLM_STUB")):
            return c
    return None


def plugin_digest(ms_dir: str) -> str:
    """A digest of MindSpore's Ascend plugin: the name and size of every plugin file plus the
    bytes of ``libmindspore_ascend.so.2`` (the library whose imports the stubs answer); 16 hex."""
    h = hashlib.sha256()
    plugin = os.path.join(ms_dir, "lib", "plugin")
    for root, _dirs, files in sorted(os.walk(plugin)):
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(f"{os.path.relpath(p, plugin)}:{os.path.getsize(p)}\n".encode())
    with open(os.path.join(plugin, "libmindspore_ascend.so.2"), "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _compile(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise MsllmError(f"building the dry-run stub layer failed: {' '.join(cmd[:6])} ...: {proc.stderr[-1500:]}")


def build_stub_tree(dest: str, ms_dir: str) -> None:
    """Write the stub tree for the MindSpore at ``ms_dir`` into the new directory ``dest``:
    ``lib64/libmsllm_stub.so`` (every symbol), one small library per CANN name with that
    one as its dependency (``dlsym`` on a handle searches its dependencies), the driver's
    libraries in ``lib64/driver``, and ``python/hccl``. Needs g++ and binutils."""
    from msllm.cluster.stub_source import stub_source
    from msllm.cluster.stub_symbols import scan_plugin

    gxx = shutil.which("g++")
    if gxx is None:
        raise MsllmError("the dry-run device layer is built with g++ (none on PATH): apt-get install g++")
    scan = scan_plugin(ms_dir)
    lib64 = os.path.join(dest, "lib64")
    os.makedirs(os.path.join(lib64, "driver"))
    src = os.path.join(dest, "stub.cc")
    with open(src, "w") as fh:
        fh.write(stub_source(scan.symbols))
    # MindSpore takes the CANN root from the path of the file defining aclrtMalloc, cut at the
    # rightmost "cann" or "latest" (GetAscendPath, dladdr): this file's name must contain neither
    core = os.path.join(lib64, "libmsllm_stub.so")
    _compile([gxx, "-shared", "-fPIC", "-O1", "-D_GLIBCXX_USE_CXX11_ABI=0", "-Wl,-soname,libmsllm_stub.so",
              "-o", core, src])
    empty = os.path.join(dest, "empty.c")
    with open(empty, "w") as fh:
        fh.write("/* a name for the loader; the symbols come from libmsllm_stub.so */\n")
    for lib in scan.libraries:
        # the driver's library lives in lib64/driver on a real install, and MindSpore looks there
        where = os.path.join(lib64, "driver") if lib.startswith(("libascend_hal", "libdrv")) else lib64
        rpath = "$ORIGIN/.." if where != lib64 else "$ORIGIN"
        _compile([gxx, "-shared", "-fPIC", "-x", "c", empty, "-o", os.path.join(where, lib), f"-Wl,-soname,{lib}",
                  "-Wl,--no-as-needed", f"-L{lib64}", "-lmsllm_stub", f"-Wl,-rpath,{rpath}"])
    pkg = os.path.join(dest, "python", "hccl")
    os.makedirs(pkg)
    with open(os.path.join(pkg, "__init__.py"), "w") as fh:
        fh.write('"""Stand-in for CANN\'s hccl package (msllm dry-run): only its version string."""\n')
    with open(os.path.join(pkg, "sys_version.py"), "w") as fh:
        fh.write(f'__sys_version__ = "{HCCL_VERSION}"\n')
    with open(os.path.join(dest, "MSLLM_STUB"), "w") as fh:
        fh.write(f"msllm dry-run stub layer: {len(scan.symbols)} symbols, {len(scan.libraries)} libraries, "
                 "generated from MindSpore's own plugin symbol tables; nothing of CANN inside\n"
                 + "\n".join(scan.libraries) + "\n")
    os.remove(empty)


def device_layer(ms_version: str | None = None, ms_dir: str | None = None) -> DeviceLayer:
    """A real CANN if one is installed, else msllm's stub tree (built once into the cache; a
    concurrent build by another rank is waited for through a lock file).

    Raises:
        MsllmError: an untested MindSpore version, or no g++/binutils to build the stubs.
    """
    if ms_version is None or ms_dir is None:
        ms_version, ms_dir = mindspore_dir()
    check_version(ms_version)
    real = find_cann()
    if real is not None:
        return DeviceLayer(real, stub=False)
    base = os.path.join(cache_root(), "cann_stub")
    key = f"ms{ms_version}-{plugin_digest(ms_dir)}-v{_STUB_FORMAT}"
    root = os.path.join(base, key, "latest")  # MindSpore finds the CANN root by "latest" in the path
    os.makedirs(base, exist_ok=True)
    with open(os.path.join(base, f".{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(root, "MSLLM_STUB")):
            log.info("building the dry-run stub device layer into %s (once; about a minute)", root)
            tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=base)
            try:
                build_stub_tree(os.path.join(tmp, "latest"), ms_dir)
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(os.path.join(base, key))
                os.rename(tmp, os.path.join(base, key))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return DeviceLayer(root, stub=True, python_path=os.path.join(root, "python"))


def simulation_env(layer: DeviceLayer, level: int, rank_id: int, rank_size: int, env: dict | None = None) -> dict:
    """The environment of a compile child for rank ``rank_id`` of ``rank_size`` at simulation
    ``level`` (0 or 1), on ``layer``. Launcher variables of a real cluster are removed: a
    simulated rank joins no cluster."""
    if level not in SIM_LEVELS:
        raise MsllmError(f"--sim_level {level}: expected 0 (compile) or 1 (compile + device memory); "
                         "levels 2 and 3 execute kernels and need an Ascend device")
    if not 0 <= rank_id < rank_size:
        raise MsllmError(f"--sim_rank_id {rank_id}: expected 0..{rank_size - 1} for {rank_size} ranks")
    out = dict(os.environ if env is None else env)
    for key in ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_ID", "RANK_TABLE_FILE",
                "MS_SIMULATION_LEVEL", "MS_DEV_SAVE_GRAPHS"):
        out.pop(key, None)
    lib64 = os.path.join(layer.root, "lib64")
    libs = [lib64, os.path.join(lib64, "driver")]
    out["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in out.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    out["ASCEND_HOME_PATH"] = layer.root
    if layer.python_path:
        out["PYTHONPATH"] = os.pathsep.join([layer.python_path] + [p for p in out.get("PYTHONPATH", "").split(
            os.pathsep) if p])
    out.update(MS_SIMULATION_LEVEL=str(level), RANK_SIZE=str(rank_size), RANK_ID=str(rank_id))
    return out


__all__ = ["DeviceLayer", "HCCL_VERSION", "SIM_LEVELS", "TESTED_MINDSPORE", "build_stub_tree", "cache_root",
           "check_version", "device_layer", "find_cann", "mindspore_dir", "plugin_digest", "simulation_env"]
