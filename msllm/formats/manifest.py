"""The checkpoint manifest (``X.ckpt.json``) and the checkpoint file-name pattern.

Manifest: ``{"format": "msllm-ckpt-v1", "file", "size", "sha256", "model_config": {...} | null,
["pet_config": {...},] **extra}`` written atomically *after* the checkpoint was renamed into place,
so a checkpoint whose manifest matches it (size and SHA-256) is known to be complete and unchanged. Written by
the trainer (extra: ``epoch``, ``step``) and by the HF converter (extra: ``converted_from``,
``source_format``, ``dtype``). ``pet_config`` (LoRA's settings, :class:`msllm.config_lora.PetConfig`)
is written by LoRA checkpoints (:mod:`msllm.lora.adapter`); manifests written before it had its own
key kept it inside ``model_config``: :func:`manifest_model_config` and :func:`manifest_pet_config`
read both forms.

Three states of a checkpoint file (:func:`checkpoint_status`):

* ``good``: the manifest exists and matches the file;
* ``unverified``: no manifest (a checkpoint written by another tool, e.g. MindFormers or a
  converter elsewhere; or an msllm save that stopped between the rename and the manifest);
* ``corrupt``: the manifest exists but is unreadable or disagrees with the file (truncated,
  bit-flipped, replaced). Such a file is never loaded and never overwritten.

File names (MindFormers' layout): ``{prefix}_{rank}-{epoch}_{step}.ckpt`` (or ``.safetensors``),
``epoch`` 1-based, ``step`` the global step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

from msllm.errors import MsllmError
from msllm.fileio import file_digest, write_json_atomic

SIDECAR_FORMAT = "msllm-ckpt-v1"
CHECKPOINT_NAME = re.compile(
    r"^(?P<prefix>.+)_(?P<rank>\d+)-(?P<epoch>\d+)_(?P<step>\d+)\.(?P<ext>ckpt|safetensors)$")
CHECKPOINT_EXTENSIONS = (".ckpt", ".safetensors")

GOOD, UNVERIFIED, CORRUPT = "good", "unverified", "corrupt"


def checkpoint_name(prefix: str, rank: int, epoch: int, step: int, fmt: str = "ckpt") -> str:
    """``{prefix}_{rank}-{epoch}_{step}.{fmt}``; epoch is 1-based, step is the global step."""
    return f"{prefix}_{rank}-{epoch}_{step}.{fmt}"


def rank_dir(output_dir: str, rank: int) -> str:
    """``{output_dir}/checkpoint/rank_{rank}``."""
    return os.path.join(output_dir, "checkpoint", f"rank_{rank}")


def parse_checkpoint_name(path: str) -> Optional[dict]:
    """``{"prefix", "rank", "epoch", "step", "ext"}`` (ints where numeric) of a file named by
    :func:`checkpoint_name`, else None."""
    m = CHECKPOINT_NAME.match(os.path.basename(path))
    if not m:
        return None
    return {"prefix": m["prefix"], "rank": int(m["rank"]), "epoch": int(m["epoch"]), "step": int(m["step"]),
            "ext": m["ext"]}


def checkpoint_step(path: str) -> Optional[int]:
    """The step in a file name of :func:`checkpoint_name`'s pattern, else None."""
    parsed = parse_checkpoint_name(path)
    return parsed["step"] if parsed else None


def sidecar_path(path: str) -> str:
    """``X.ckpt`` -> ``X.ckpt.json``: the checkpoint's manifest."""
    return path + ".json"


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file."""
    return file_digest(path, "sha256")


def write_sidecar(path: str, model_config=None, pet_config=None, **extra) -> dict:
    """Write the manifest of checkpoint ``path`` to ``path + ".json"``, atomically; returns it.

    ``model_config`` is a :class:`LlamaConfig` or a dict of its fields; with it, tools can
    rebuild the model (e.g. HF export) without a YAML. ``pet_config`` (a
    :class:`~msllm.config_lora.PetConfig` or a dict of its keys; None: no key written) is LoRA's
    settings, under its own ``"pet_config"`` key.
    """
    if model_config is not None and not isinstance(model_config, dict):
        model_config = dataclasses.asdict(model_config)
    if pet_config is not None:
        extra = {"pet_config": pet_config if isinstance(pet_config, dict) else dataclasses.asdict(pet_config),
                 **extra}
    manifest = {"format": SIDECAR_FORMAT, "file": os.path.basename(path),
                "size": os.path.getsize(path), "sha256": file_sha256(path),
                "model_config": model_config, **extra}
    write_json_atomic(sidecar_path(path), manifest)
    return manifest


def manifest_model_config(manifest: Optional[dict]) -> Optional[dict]:
    """The manifest's ``"model_config"`` as :class:`~msllm.models.llama.config.LlamaConfig`'s fields
    (a new dict; None if it records none): a ``"pet_config"`` inside it (manifests written before
    LoRA's settings had their own key) is dropped, :func:`manifest_pet_config` reads it."""
    mc = (manifest or {}).get("model_config")
    if not isinstance(mc, dict) or not mc:
        return None
    return {k: v for k, v in mc.items() if k != "pet_config"}


def manifest_pet_config(manifest: Optional[dict]):
    """LoRA's settings a manifest records (:class:`~msllm.config_lora.PetConfig`), or None: its own
    ``"pet_config"`` key, else the ``"pet_config"`` inside ``"model_config"`` (manifests written
    before the key), else an adapter manifest's ``"lora"`` record's.

    Raises MsllmError for a recorded value that is not a mapping of PetConfig's keys."""
    from msllm.config_lora import pet_config_from

    manifest = manifest or {}
    for where, value in (("pet_config", manifest.get("pet_config")),
                         ("model_config.pet_config", (manifest.get("model_config") or {}).get("pet_config")),
                         ("lora.pet_config", (manifest.get("lora") or {}).get("pet_config"))):
        if value is not None:
            return pet_config_from(value, f"checkpoint manifest {where}")
    return None


def read_sidecar(path: str) -> Optional[dict]:
    """The manifest of checkpoint ``path``, or None if there is none.

    Raises MsllmError if the manifest exists but is not valid JSON of the expected format.
    """
    side = sidecar_path(path)
    if not os.path.exists(side):
        return None
    try:
        with open(side, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MsllmError(f"checkpoint manifest {side!r} is unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise MsllmError(f"checkpoint manifest {side!r}: expected format {SIDECAR_FORMAT!r}")
    return data


def checkpoint_status(path: str, full: bool = True) -> tuple[str, Optional[str]]:
    """``(GOOD | UNVERIFIED | CORRUPT, reason)`` of checkpoint file ``path`` (see the module
    docstring); ``reason`` is None for GOOD. ``full=False`` compares only the size, not the
    SHA-256 (for frequent checks)."""
    try:
        manifest = read_sidecar(path)
    except MsllmError as exc:
        return CORRUPT, str(exc)
    if manifest is None:
        return UNVERIFIED, "no manifest (written by another tool, or the save did not finish)"
    if not os.path.exists(path):
        return CORRUPT, "file missing (its manifest exists)"
    size = os.path.getsize(path)
    if size != manifest.get("size"):
        return CORRUPT, f"size {size} bytes, its manifest says {manifest.get('size')} (truncated or replaced)"
    if full and file_sha256(path) != manifest.get("sha256"):
        return CORRUPT, "SHA-256 differs from its manifest (corrupt)"
    return GOOD, None


def verify_checkpoint(path: str, full: bool = True) -> Optional[str]:
    """Why ``path`` is not a complete checkpoint with a matching manifest, or None if it is
    (:func:`checkpoint_status`: anything but GOOD gives its reason)."""
    return checkpoint_status(path, full)[1]


def refuse_corrupt(path: str, what: str = "checkpoint") -> None:
    """Raise MsllmError if ``path`` has a manifest that disagrees with it (CORRUPT)."""
    status, reason = checkpoint_status(path)
    if status == CORRUPT:
        raise MsllmError(f"{what} {path} does not match its manifest {sidecar_path(path)}: {reason}; "
                         "refusing to use it")


def checkpoint_files(directory: str) -> list[str]:
    """Checkpoint files of ``directory``, oldest first: those named by :func:`checkpoint_name`
    ordered by step; if there are none, any other ``*.ckpt`` / ``*.safetensors`` files in
    lexical order (MindSpore's rule for foreign names)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    named, other = [], []
    for fn in names:
        path = os.path.join(directory, fn)
        if not fn.endswith(CHECKPOINT_EXTENSIONS) or not os.path.isfile(path):
            continue
        step = checkpoint_step(fn)
        if step is None:
            other.append(path)
        else:
            named.append((step, path))
    return [p for _, p in sorted(named)] if named else sorted(other)


__all__ = ["SIDECAR_FORMAT", "CHECKPOINT_NAME", "GOOD", "UNVERIFIED", "CORRUPT", "checkpoint_name", "rank_dir",
           "parse_checkpoint_name", "checkpoint_step", "sidecar_path", "file_sha256", "write_sidecar",
           "manifest_model_config", "manifest_pet_config",
           "read_sidecar", "checkpoint_status", "verify_checkpoint", "refuse_corrupt", "checkpoint_files"]
