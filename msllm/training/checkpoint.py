"""Checkpoint files: atomic save, naming, retention, finding the newest, loading.

Layout (MindFormers-compatible): ``{output_dir}/checkpoint/rank_{r}/{prefix}_{r}-{epoch}_{step}.ckpt``
(or ``.safetensors``). A checkpoint of the train step holds the network parameters, the
optimizer moments (``adam_m.*``, ``adam_v.*``), ``global_step`` and ``loss_scale``, plus
``epoch_num`` / ``step_num`` entries, so it is enough to resume.
"""

from __future__ import annotations

import glob
import logging
import os
import re

from msllm.errors import MsllmError
from msllm.fileio import atomic_path

log = logging.getLogger("msllm")

_NAME = re.compile(r"^(?P<prefix>.+)_(?P<rank>\d+)-(?P<epoch>\d+)_(?P<step>\d+)\.(?P<ext>ckpt|safetensors)$")


def rank_dir(output_dir: str, rank: int) -> str:
    """``{output_dir}/checkpoint/rank_{rank}``."""
    return os.path.join(output_dir, "checkpoint", f"rank_{rank}")


def checkpoint_name(prefix: str, rank: int, epoch: int, step: int, fmt: str = "ckpt") -> str:
    """``{prefix}_{rank}-{epoch}_{step}.{fmt}``; epoch is 1-based, step is the global step."""
    return f"{prefix}_{rank}-{epoch}_{step}.{fmt}"


def list_checkpoints(directory: str, prefix: str | None = None) -> list[str]:
    """Checkpoints in ``directory`` named by :func:`checkpoint_name`, oldest step first."""
    found = []
    for path in glob.glob(os.path.join(directory, "*")):
        m = _NAME.match(os.path.basename(path))
        if m and (prefix is None or m["prefix"] == prefix):
            found.append((int(m["step"]), path))
    return [p for _, p in sorted(found)]


def save_checkpoint(cell, path: str, epoch: int, step: int, fmt: str = "ckpt") -> str:
    """Save every parameter of ``cell`` to ``path`` atomically (temp name, then rename).

    Extra entries ``epoch_num`` and ``step_num`` (int) are stored with the parameters, as
    MindFormers does. Returns ``path``.
    """
    import mindspore as ms

    with atomic_path(path) as tmp:
        ms.save_checkpoint(cell, tmp, append_dict={"epoch_num": epoch, "step_num": step}, format=fmt)
    return path


def prune_checkpoints(directory: str, prefix: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` (>= 1) checkpoints of ``prefix``; returns the deleted."""
    keep = max(1, keep)
    paths = list_checkpoints(directory, prefix)
    doomed = paths[:-keep]
    for p in doomed:
        os.remove(p)
    return doomed


def resolve_checkpoint(path: str, rank: int) -> str:
    """A checkpoint file from ``load_checkpoint``: a file, or a directory holding ``rank_{r}/``
    subdirectories or checkpoint files (then the newest step is taken).

    Raises MsllmError naming ``path`` if nothing loadable is there.
    """
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise MsllmError(f"load_checkpoint {path!r} does not exist")
    for directory in (os.path.join(path, f"rank_{rank}"), os.path.join(path, "checkpoint", f"rank_{rank}"), path):
        found = list_checkpoints(directory)
        if found:
            return found[-1]
    raise MsllmError(f"load_checkpoint {path!r}: no checkpoint files (*_R-E_S.ckpt) for rank {rank} found")


def load_params(path: str) -> dict:
    """Read a checkpoint into ``{name: Parameter}``; MsllmError naming the file if unreadable."""
    import mindspore as ms

    fmt = "safetensors" if path.endswith(".safetensors") else "ckpt"
    try:
        return ms.load_checkpoint(path, format=fmt)
    except Exception as exc:  # MindSpore raises ValueError/RuntimeError with long texts
        raise MsllmError(f"checkpoint {path!r} cannot be read: {str(exc).splitlines()[0]}") from None


def load_into(cell, params: dict, path: str, strict: bool = True) -> list[str]:
    """Copy ``params`` into ``cell``'s parameters after checking names and shapes.

    Raises MsllmError naming the file and the first mismatching parameter (shape or, with
    ``strict``, a network parameter missing from the file). Returns the names not found
    (only when not strict).
    """
    import mindspore as ms

    missing = []
    for p in cell.get_parameters():
        src = params.get(p.name)
        if src is None:
            missing.append(p.name)
            continue
        if tuple(src.shape) != tuple(p.shape):
            raise MsllmError(f"checkpoint {path!r}: parameter {p.name} has shape {tuple(src.shape)}, "
                             f"the model built from the config expects {tuple(p.shape)}")
    if strict and missing:
        raise MsllmError(f"checkpoint {path!r} lacks {len(missing)} parameter(s) of the model, "
                         f"e.g. {missing[0]}")
    ms.load_param_into_net(cell, {k: v for k, v in params.items() if k not in ("epoch_num", "step_num")},
                           strict_load=False)
    return missing
