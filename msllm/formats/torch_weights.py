"""PyTorch weight files (``pytorch_model*.bin``, Meta ``consolidated.NN.pth``), read safely.

Only ``torch.load(..., weights_only=True)`` is used (no arbitrary unpickling), memory-mapped
when the file is in the zip format (torch >= 1.6 ``_use_new_zipfile_serialization``), so a
tensor's bytes are read when it is loaded. torch is imported only here, on demand.
"""

from __future__ import annotations

import numpy as np

from msllm.errors import MsllmError
from msllm.formats.dtypes import TensorRef

TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
                "torch.float64": "float64", "torch.int32": "int32", "torch.int64": "int64"}


def torch_load(path: str) -> dict:
    """``torch.load(path, weights_only=True)`` memory-mapped when the file allows it; a
    ``{"state_dict": {...}}`` wrapper is unwrapped. MsllmError naming the file otherwise."""
    try:
        import torch
    except ImportError:
        raise MsllmError(f"{path}: reading .bin/.pth weights needs torch (pip install -e \".[convert]\")") from None

    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # legacy (non-zip) files cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle / zip errors come in many types
        raise MsllmError(f"{path}: cannot be read with torch.load(weights_only=True): "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise MsllmError(f"{path}: expected a dict of tensors, got {type(sd).__name__}")
    return sd


def torch_to_storage(t) -> np.ndarray:
    """A torch tensor -> storage array (bfloat16 as its uint16 bits), no rounding."""
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def torch_refs(path: str) -> dict[str, TensorRef]:
    """``{name: TensorRef}`` of a torch weight file; MsllmError for a non-tensor entry or an
    unsupported dtype."""
    import torch

    sd = torch_load(path)
    refs = {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise MsllmError(f"{path}: entry {name!r} is a {type(t).__name__}, not a tensor")
        dtype = TORCH_DTYPES.get(str(t.dtype))
        if dtype is None:
            raise MsllmError(f"{path}: tensor {name} has dtype {t.dtype}; supported: {sorted(TORCH_DTYPES)}")
        refs[name] = TensorRef(name, tuple(t.shape), dtype, path, lambda t=t: torch_to_storage(t))
    return refs


__all__ = ["torch_load", "torch_refs", "torch_to_storage", "TORCH_DTYPES"]
