"""Checkpoint files: atomic save, naming, retention, finding the newest, loading.

Layout (MindFormers-compatible): ``{output_dir}/checkpoint/rank_{r}/{prefix}_{r}-{epoch}_{step}.ckpt``
(or ``.safetensors``). A checkpoint of the train step holds the network parameters, the
optimizer moments (``adam_m.*``, ``adam_v.*``), ``global_step`` and ``loss_scale``, plus
``epoch_num`` / ``step_num`` entries, so it is enough to resume.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re

from msllm.errors import MsllmError
from msllm.fileio import atomic_path, file_digest, write_json_atomic

log = logging.getLogger("msllm")

SIDECAR_FORMAT = "msllm-ckpt-v1"
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


def sidecar_path(path: str) -> str:
    """``X.ckpt`` -> ``X.ckpt.json``: the checkpoint's manifest."""
    return path + ".json"


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file."""
    return file_digest(path, "sha256")


def write_sidecar(path: str, model_config=None, **extra) -> dict:
    """Write the manifest of checkpoint ``path``: ``{"format": "msllm-ckpt-v1", "file", "size",
    "sha256", "model_config": {...} | null, **extra}`` to ``path + ".json"``, atomically.

    ``model_config`` is a :class:`LlamaConfig` or a dict of its fields; with it, tools can
    rebuild the model (e.g. HF export) without a YAML.
    """
    if model_config is not None and not isinstance(model_config, dict):
        model_config = dataclasses.asdict(model_config)
    manifest = {"format": SIDECAR_FORMAT, "file": os.path.basename(path),
                "size": os.path.getsize(path), "sha256": file_sha256(path),
                "model_config": model_config, **extra}
    write_json_atomic(sidecar_path(path), manifest)
    return manifest


def read_sidecar(path: str) -> dict | None:
    """The manifest of checkpoint ``path``, or None if there is none.

    Raises MsllmError if the manifest exists but is not valid JSON of the expected format.
    """
    side = sidecar_path(path)
    if not os.path.exists(side):
        return None
    try:
        with open(side, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise MsllmError(f"checkpoint manifest {side!r} is unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise MsllmError(f"checkpoint manifest {side!r}: expected format {SIDECAR_FORMAT!r}")
    return data


def save_checkpoint(cell, path: str, epoch: int, step: int, fmt: str = "ckpt", model_config=None) -> str:
    """Save every parameter of ``cell`` to ``path`` atomically, then its manifest.

    The checkpoint is written under a temporary name and renamed; the manifest
    (:func:`write_sidecar`: size, SHA-256, model config, epoch, step) is written after the
    rename, so a checkpoint with a matching manifest is known to be complete. Extra entries
    ``epoch_num`` and ``step_num`` (int) are stored with the parameters, as MindFormers does.
    Returns ``path``.
    """
    import mindspore as ms

    with atomic_path(path) as tmp:
        ms.save_checkpoint(cell, tmp, append_dict={"epoch_num": epoch, "step_num": step}, format=fmt)
    write_sidecar(path, model_config, epoch=epoch, step=step)
    return path


def verify_checkpoint(path: str, full: bool = True) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None if it is: its manifest exists and
    the file's size and (with ``full``) SHA-256 match the manifest."""
    try:
        manifest = read_sidecar(path)
    except MsllmError as exc:
        return str(exc)
    if manifest is None:
        return "no manifest (the save did not finish)"
    if not os.path.exists(path):
        return "file missing"
    size = os.path.getsize(path)
    if size != manifest.get("size"):
        return f"size {size} bytes, manifest says {manifest.get('size')}"
    if full and file_sha256(path) != manifest.get("sha256"):
        return "SHA-256 differs from the manifest (corrupt)"
    return None


def good_checkpoints(directory: str, prefix: str | None = None, full: bool = True) -> dict[int, str]:
    """``{step: path}`` of the complete checkpoints in ``directory`` (:func:`verify_checkpoint`;
    ``full=False`` skips the SHA-256, for the frequent retention check).

    Each incomplete or corrupt checkpoint newer than the newest good one is reported with a
    warning naming it and the good one that will be used instead.
    """
    good: dict[int, str] = {}
    bad: list[tuple[str, str]] = []
    for path in list_checkpoints(directory, prefix):
        reason = verify_checkpoint(path, full)
        step = int(_NAME.match(os.path.basename(path))["step"])
        if reason is None:
            good[step] = path
        else:
            bad.append((path, reason))
    newest_good = max(good) if good else -1
    for path, reason in bad:
        if int(_NAME.match(os.path.basename(path))["step"]) > newest_good:
            log.warning("checkpoint %s is not usable (%s); using %s instead", path, reason,
                        good[newest_good] if good else "no checkpoint")
    return good


def prune_checkpoints(directory: str, prefix: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` (>= 1) complete checkpoints of ``prefix``; delete older ones
    (complete or not). The newest complete checkpoint is never deleted, and nothing newer than
    it is touched (it may be being written). Returns the deleted paths."""
    keep = max(1, keep)
    good = good_checkpoints(directory, prefix, full=False)
    if not good:
        return []
    kept_steps = sorted(good)[-keep:]
    oldest_kept = kept_steps[0]
    doomed = [p for p in list_checkpoints(directory, prefix)
              if int(_NAME.match(os.path.basename(p))["step"]) < oldest_kept]
    for p in doomed:
        os.remove(p)
        if os.path.exists(sidecar_path(p)):
            os.remove(sidecar_path(p))
    return doomed


def checkpoint_search_dir(path: str, rank: int) -> str | None:
    """The directory holding rank ``rank``'s checkpoints for a ``load_checkpoint`` value: the
    directory of a file, ``path/rank_{r}``, ``path/checkpoint/rank_{r}``, or ``path`` itself."""
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    for directory in (os.path.join(path, f"rank_{rank}"), os.path.join(path, "checkpoint", f"rank_{rank}"), path):
        if os.path.isdir(directory) and list_checkpoints(directory):
            return directory
    return None


def resolve_checkpoint(path: str, rank: int) -> str:
    """A checkpoint file from ``load_checkpoint``: the file itself, or the newest complete
    checkpoint found by :func:`checkpoint_search_dir` (the newest by name if none has a manifest,
    e.g. a checkpoint written by another tool).

    Raises MsllmError naming ``path`` if nothing loadable is there.
    """
    if os.path.isfile(path):
        return path
    if not os.path.exists(path):
        raise MsllmError(f"load_checkpoint {path!r} does not exist")
    directory = checkpoint_search_dir(path, rank)
    if directory is None:
        raise MsllmError(f"load_checkpoint {path!r}: no checkpoint files (*_R-E_S.ckpt) for rank {rank} found")
    good = good_checkpoints(directory)
    return good[max(good)] if good else list_checkpoints(directory)[-1]


def load_params(path: str) -> dict:
    """Read a checkpoint into ``{name: Parameter}`` under msllm names.

    Checkpoints in MindFormers' LLaMA naming (``model.layers.0.attention.wq.weight`` ...) are
    renamed (:func:`msllm.convert.names.to_msllm_names`), so MindFormers users can bring theirs.
    Raises MsllmError naming the file if it is unreadable.
    """
    import mindspore as ms

    from msllm.convert.names import to_msllm_names

    fmt = "safetensors" if path.endswith(".safetensors") else "ckpt"
    try:
        params = ms.load_checkpoint(path, format=fmt)
    except Exception as exc:  # MindSpore raises ValueError/RuntimeError with long texts
        raise MsllmError(f"checkpoint {path!r} cannot be read: {str(exc).splitlines()[0]}") from None
    return to_msllm_names(params, path)


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
