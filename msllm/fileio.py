"""Atomic output: nothing half-written is ever left under a final name.

Pattern: write to a temporary name in the same directory (so the rename stays on one file system
and is atomic, POSIX ``rename(2)``), then ``os.replace`` it onto the final name; on any exception
the temporary file is removed and the final name is untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable, Iterator


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
def exclusive_lock(lock_path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_path`` (created if missing) until the block ends: one
    process at a time, the others wait. The kernel releases it when the process dies."""
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_dir_once(target: str, build: Callable[[str], None],
                   ready: Callable[[str], bool] = os.path.isdir) -> str:
    """``target`` (a directory, e.g. a cache), built by ``build(tmp_dir)`` unless ``ready(target)``.

    Safe when several processes ask at once (two pytest-xdist workers, the ranks of a job): an
    exclusive lock on ``.<name>.lock`` beside ``target``; the first process builds into a temporary
    directory beside it and renames it into place, the others wait for the lock and then find it
    ready. Nothing half-built is ever visible under ``target``; a failed build leaves nothing.
    """
    target = os.path.abspath(target)
    if ready(target):
        return target
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    with exclusive_lock(os.path.join(parent, f".{name}.lock")):
        if ready(target):  # another process built it while this one waited
            return target
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        try:
            build(tmp)
            if os.path.lexists(target):  # not ready: a damaged or older copy
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


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
