"""Atomic output: nothing half-written is ever left under a final name.

Pattern: write to a temporary name in the same directory (so the rename stays on one file system
and is atomic, POSIX ``rename(2)``), then ``os.replace`` it onto the final name; on any exception
the temporary file is removed and the final name is untouched.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import tempfile
from typing import Iterator


def temp_path_for(path: str) -> str:
    """A fresh, not-yet-existing temporary path beside ``path``: same directory, same extension.

    The extension is kept because some writers add their own when it is missing (MindSpore's
    ``save_checkpoint`` appends ``.ckpt``), e.g. ``a/x.ckpt`` -> ``a/.x.k3j9.tmp.ckpt``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    stem, ext = os.path.splitext(os.path.basename(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{ext}", dir=directory)
    os.close(fd)
    os.unlink(tmp)
    return tmp


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path to write ``path`` through; rename it onto ``path`` on success.

    For libraries that take a file name (MindSpore ``save_checkpoint``, safetensors ...).
    The parent directory is created if missing. On an exception the temporary file is removed
    and the exception propagates; ``path`` keeps its previous content (or stays absent).
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = temp_path_for(path)
    try:
        yield tmp
        if not os.path.exists(tmp):
            raise FileNotFoundError(f"nothing was written to the temporary file for {path}")
        os.replace(tmp, path)
    except BaseException:
        # also the writer's own temporaries named after ours (MindSpore's save_checkpoint
        # writes "<name minus .ckpt>.tmp" first and leaves it behind when the write fails);
        # the random part of our name makes this prefix unique
        for leftover in [tmp] + glob.glob(glob.escape(os.path.splitext(tmp)[0]) + "*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
        raise


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", encoding: str | None = "utf-8"):
    """``open()`` for writing that only publishes the file under ``path`` once it is complete.

    The data is flushed and fsync'ed before the rename, so a crash leaves either the old file
    or the new one, never a truncated one.
    """
    if "b" in mode:
        encoding = None
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())


def write_json_atomic(path: str, obj: object, indent: int | None = 2) -> None:
    """Write ``obj`` as UTF-8 JSON to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path, "w") as fh:
        json.dump(obj, fh, indent=indent, ensure_ascii=False)
        fh.write("\n")


def file_digest(path: str, algorithm: str = "sha256") -> str:
    """Hex digest (``hashlib`` algorithm name) of the file at ``path``, read in 1 MiB chunks."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
