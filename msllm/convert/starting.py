"""Starting weights: what ``load_checkpoint`` names (the base a fine-tune starts from, full or
LoRA, and the base an adapter belongs to): its identity (path and SHA-256), its weights, loading it.

A base is one of what ``load_checkpoint`` accepts: an msllm ``.ckpt`` / ``.safetensors`` (msllm
or MindFormers naming, with or without trainer entries), or a Hugging Face directory
(``config.json`` + safetensors / ``.bin`` shards). A directory of msllm checkpoints
(``.../checkpoint`` with ``rank_{r}``) resolves to the newest complete checkpoint of rank 0, as the
trainer does.

Identity (recorded in every adapter manifest, compared on resume, merge and adapter loading):
``{"path": absolute path, "sha256": hex, "kind": "checkpoint" | "hf_dir"}``. For a checkpoint
file, the SHA-256 of the file. For an HF directory, the SHA-256 of the text
``"<file name> <file sha256>\\n"`` over its ``config.json`` and weight files
(``*.safetensors``, ``*.bin``, ``*.pth``, their index ``*.index.json``, ``params.json``) in name order, so
any change to the weights or the config changes it, and tokenizer files do not.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

from msllm.errors import MsllmError
from msllm.fileio import file_digest

_HF_FILES = re.compile(r"^(config\.json|params\.json|.*\.safetensors|.*\.bin|.*\.pth|.*\.index\.json)$")


def is_hf_dir(path: str) -> bool:
    """True for a directory with ``config.json`` or ``params.json`` (an HF / Meta checkpoint)."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "config.json")) or
                                    os.path.isfile(os.path.join(path, "params.json")))


def resolve_base(path: str, rank: int = 0) -> str:
    """The file or HF directory ``path`` names (see the module docstring). MsllmError if missing."""
    if not path:
        raise MsllmError("LoRA needs a base model: set load_checkpoint (an msllm/MindFormers checkpoint "
                         "or a Hugging Face directory)")
    if os.path.isfile(path) or is_hf_dir(path):
        return os.path.abspath(path)
    if not os.path.exists(path):
        raise MsllmError(f"base model {path!r} does not exist")
    from msllm.formats.loading import resolve_checkpoint

    return os.path.abspath(resolve_checkpoint(path, rank))


def base_identity(path: str, rank: int = 0) -> dict:
    """``{"path", "sha256", "kind"}`` of base ``path`` (see the module docstring)."""
    real = resolve_base(path, rank)
    if os.path.isfile(real):
        return {"path": real, "sha256": file_digest(real, "sha256"), "kind": "checkpoint"}
    files = sorted(f for f in os.listdir(real) if _HF_FILES.match(f) and os.path.isfile(os.path.join(real, f)))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f} {file_digest(os.path.join(real, f), 'sha256')}\n".encode("utf-8"))
    return {"path": real, "sha256": digest.hexdigest(), "kind": "hf_dir"}


def check_same_base(recorded: Optional[dict], base_path: str, what: str, rank: int = 0) -> dict:
    """Compare base ``base_path`` with the identity ``recorded`` in ``what`` (an adapter).

    Returns the identity of ``base_path``. Raises MsllmError naming both paths and digests when
    the SHA-256 differs. A record of None (an adapter imported from PEFT without ``--base``)
    is accepted: then only shapes are checked, by the caller.
    """
    found = base_identity(base_path, rank)
    if recorded and recorded.get("sha256") != found["sha256"]:
        raise MsllmError(f"base model {found['path']} (SHA-256 {found['sha256'][:16]}...) is not the base "
                         f"{what} was trained on: {recorded.get('path')} (SHA-256 "
                         f"{str(recorded.get('sha256'))[:16]}...); pass that base model")
    return found


@dataclass
class BaseWeights:
    """The weights of a base model, read lazily: ``config`` (LlamaConfig), ``refs``
    ({msllm name: TensorRef}, storage arrays on ``load()``), ``close()``."""

    path: str
    config: object
    refs: dict
    close: Callable[[], None]


def open_base(path: str, model_config=None, rank: int = 0) -> BaseWeights:
    """Open base ``path`` for reading weights one tensor at a time.

    The model config comes from the HF ``config.json``, else the checkpoint's manifest, else
    ``model_config`` (e.g. the adapter manifest's). Raises MsllmError (from the converters)
    for unknown, missing or mis-shaped tensors.
    """
    real = resolve_base(path, rank)
    if os.path.isdir(real):
        from msllm.convert.sources import open_hf_source

        src = open_hf_source(real)
        return BaseWeights(real, src.config, src.params, src.close)
    from msllm.convert.driver import msllm_model_config, msllm_weights
    from msllm.formats.manifest import read_sidecar

    manifest = read_sidecar(real)
    cfg = msllm_model_config(real, None) if manifest and manifest.get("model_config") else model_config
    if cfg is None:
        raise MsllmError(f"base checkpoint {real} has no manifest with a model_config; the model shape "
                         "is unknown (the adapter manifest's model_config is used when there is one)")
    return BaseWeights(real, cfg, msllm_weights(real, cfg), lambda: None)


def load_base_into(network, path: str, rank: int = 0) -> dict:
    """Load base weights ``path`` into ``network`` (a full fine-tune's starting weights, or a LoRA
    base before or after :func:`~msllm.lora.apply.apply_lora`). The base parameters are the model's
    own (:func:`msllm.models.llama.names.param_shapes` of ``network.config``; adapters and optimizer
    states are not expected in the base); each must be in the file with its shape. Returns the
    base identity (:func:`base_identity`).
    """
    import mindspore as ms

    from msllm.formats.dtypes import to_float32
    from msllm.models.llama.names import param_shapes

    real = resolve_base(path, rank)
    own = param_shapes(network.config)
    base_params = [p for p in network.get_parameters() if p.name in own]
    if os.path.isdir(real):
        src = open_base(real)
        try:
            for p in base_params:
                ref = src.refs.get(p.name)
                if ref is None:
                    raise MsllmError(f"base model {real} lacks parameter {p.name} of the model")
                if tuple(ref.shape) != tuple(p.shape):
                    raise MsllmError(f"base model {real}: parameter {p.name} has shape {tuple(ref.shape)}, the "
                                     f"model built from the config expects {tuple(p.shape)}")
                p.set_data(ms.Tensor(to_float32(ref.load(), ref.dtype)).astype(p.dtype))
        finally:
            src.close()
    else:  # the trainer's own loader: MindFormers names, qkv_concat splits, shape checks
        from msllm.formats.loading import load_into, load_params

        missing = load_into(network, load_params(real), real, strict=False)
        missing = [m for m in missing if m in own]
        if missing:
            raise MsllmError(f"base model {real} lacks {len(missing)} parameter(s) of the model, e.g. {missing[0]}")
    return base_identity(real, rank)


__all__ = ["is_hf_dir", "resolve_base", "base_identity", "check_same_base", "BaseWeights", "open_base",
           "load_base_into"]
