"""What MindSpore's Ascend plugin needs from CANN, read from the installed wheel's own files.

MindSpore 2.10's Ascend plugin (``mindspore/lib/plugin/libmindspore_ascend.so.2`` and the
libraries under ``plugin/ascend/``) links against CANN's libraries (``libascendcl.so``,
``libge_runner.so``, ``libhccl.so`` ...) and looks further functions up at run time by name
(``dlopen`` + ``dlsym``). On a machine without CANN the plugin does not load, so MindSpore's
simulation ("dry-run", ``MS_SIMULATION_LEVEL``) cannot start. :func:`scan_plugin` lists, from
the wheel alone:

* the library names the plugin needs (ELF ``DT_NEEDED`` entries, via ``readelf -d``) or opens by
  name (``lib*.so`` strings in its read-only data) that neither the wheel nor the system provides;
* the symbols those libraries would have to define: every symbol the plugin leaves undefined
  (``nm -D --undefined-only``, strong references only) minus those defined by MindSpore's own
  libraries, the C/C++ runtime (libc, libm, libstdc++, libgcc_s, libgomp, the dynamic loader)
  and Python's C API; plus the names of CANN functions the plugin resolves with ``dlsym``
  (identifiers with CANN's API prefixes in its string tables: ``acl*``, ``Hccl*``, ``rt*``,
  ``Msprof*`` ...).

Nothing of CANN is read or copied: the result is a list of names taken from MindSpore's files.
Needs binutils (``nm``, ``readelf``) on PATH; :class:`msllm.errors.MsllmError` says so otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from msllm.errors import MsllmError

# The C/C++ runtime every plugin library links against; their symbols are never CANN's.
SYSTEM_LIBS = ("libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libgomp.so.1",
               "libpthread.so.0", "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2")
# CANN's public C API prefixes (AscendCL acl*, HCCL, runtime rt*, profiling, logging, mmpa, the
# driver's hal*/drv*, ATB), used to pick dlsym'd names out of string tables. An extra name only
# adds one more stub that returns 0; a missing one shows as a compile-time error naming it.
_DLSYM_NAME = re.compile(rb"(?<![A-Za-z0-9_])((?:acl[a-z]*|Hccl|hccl|rt|Msprof|msprof|prof|aclprof|Alog|Dlog|"
                         rb"dlog|mm|hal|drv|atb|ge|Ge)[A-Z][A-Za-z0-9_]{2,80})\x00")
# a bare library name, or one relative to the CANN root (MindSpore opens "lib64/libascendcl.so",
# "lib64/driver/libascend_hal.so" under ASCEND_HOME_PATH); other paths are not CANN's
_LIB_NAME = re.compile(rb"(?<![A-Za-z0-9_./-])/?(?:lib64/(?:driver/)?)?(lib[A-Za-z0-9_]+\.so(?:\.[0-9]+)*)\x00")
_PYTHON_API = re.compile(r"^_?Py|^_Py")


@dataclass(frozen=True)
class PluginScan:
    """The result of :func:`scan_plugin`.

    libraries: sorted names of the libraries to provide (``libascendcl.so`` ...).
    symbols: sorted symbol names (C names and Itanium-mangled C++ names) the stubs export.
    plugin_files: the plugin libraries read (absolute paths), for the cache key.
    """

    libraries: tuple
    symbols: tuple
    plugin_files: tuple


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise MsllmError(f"the dry-run device layer needs binutils' {name!r} on PATH to read MindSpore's "
                         "plugin libraries (apt-get install binutils)")
    return path


def _is_x86_64_elf(path: str) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(20)
    return head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 62  # EM_X86_64


def plugin_files(ms_dir: str) -> list[str]:
    """MindSpore's Ascend plugin libraries in the wheel at ``ms_dir`` (x86-64 ELF only: the wheel
    also ships AI-CPU kernels built for aarch64, which the host never loads)."""
    plugin = os.path.join(ms_dir, "lib", "plugin")
    names = [os.path.join(plugin, n) for n in ("libmindspore_ascend.so.2", "libmindspore_ops_ascend.so")]
    for root, _dirs, files in os.walk(os.path.join(plugin, "ascend")):
        names += [os.path.join(root, f) for f in files if f.endswith(".so")]
    out = sorted(p for p in names if os.path.isfile(p) and _is_x86_64_elf(p))
    if not any(p.endswith("libmindspore_ascend.so.2") for p in out):
        raise MsllmError(f"{plugin}: no libmindspore_ascend.so.2; this MindSpore wheel has no Ascend plugin")
    return out


def _wheel_libraries(ms_dir: str) -> tuple[set, list[str]]:
    names, paths = set(), []
    for root, _dirs, files in os.walk(ms_dir):
        for f in files:
            if ".so" in f:
                names.add(f)
                p = os.path.join(root, f)
                if os.path.isfile(p) and _is_x86_64_elf(p):
                    paths.append(p)
    return names, paths


def _system_stems() -> set:
    """Stems (``libssl``) of the libraries the dynamic loader knows (``ldconfig -p``)."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        text = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    return {line.split()[0].split(".so")[0] for line in text.splitlines()[1:] if line.strip()}


def _nm(path: str, undefined: bool) -> list[tuple[str, str]]:
    flag = "--undefined-only" if undefined else "--defined-only"
    out = subprocess.run([_tool("nm"), "-D", flag, path], capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            rows.append((parts[-2], parts[-1].split("@")[0]))
    return rows


def _needed(path: str) -> list[str]:
    out = subprocess.run([_tool("readelf"), "-d", path], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def _system_symbols() -> set:
    found = set()
    for name in SYSTEM_LIBS:
        for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
            p = os.path.join(d, name)
            if os.path.exists(p):
                found |= {s for _t, s in _nm(p, undefined=False)}
                break
    return found


def scan_plugin(ms_dir: str) -> PluginScan:
    """Read MindSpore's Ascend plugin at ``ms_dir`` (the ``mindspore`` package directory) and
    return what a stand-in for CANN must provide (see the module docstring)."""
    files = plugin_files(ms_dir)
    wheel_names, wheel_paths = _wheel_libraries(ms_dir)
    defined = set()
    for p in wheel_paths:
        defined |= {s for _t, s in _nm(p, undefined=False)}
    defined |= _system_symbols()
    stems = _system_stems()
    libs, symbols = set(), set()
    for p in files:
        for kind, sym in _nm(p, undefined=True):
            if kind == "U" and sym not in defined and not _PYTHON_API.match(sym):
                symbols.add(sym)
        with open(p, "rb") as fh:
            data = fh.read()
        symbols |= {m.decode() for m in _DLSYM_NAME.findall(data)} - defined
        for lib in set(_needed(p)) | {m.decode() for m in _LIB_NAME.findall(data)}:
            if lib in wheel_names or lib in SYSTEM_LIBS or lib.split(".so")[0] in stems:
                continue
            libs.add(lib)
    return PluginScan(tuple(sorted(libs)), tuple(sorted(symbols)), tuple(files))


__all__ = ["PluginScan", "SYSTEM_LIBS", "plugin_files", "scan_plugin"]
