"""Tensor dtypes as the checkpoint readers and writers hold them, and lazily loaded tensors.

Arrays are held in a "storage" numpy dtype: float32, float16, float64, int32, int64, and
bfloat16 as its raw uint16 bits (numpy has no bfloat16). Names are msllm's long names
(``float32``, ``bfloat16`` ...); each file format maps its own codes to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np

from msllm.errors import MsllmError

DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float64": np.float64,
           "int32": np.int32, "int64": np.int64}
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def normalize_dtype(name: Optional[str]) -> Optional[str]:
    """``fp32``/``fp16``/``bf16`` (or the long names) -> ``float32``/``float16``/``bfloat16``;
    None stays None (keep the input dtype). MsllmError for anything else."""
    if name is None:
        return None
    if name not in DTYPE_ALIASES:
        raise MsllmError(f"--dtype {name!r}: expected fp32, fp16 or bf16")
    return DTYPE_ALIASES[name]


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> bfloat16 bits (uint16), round to nearest even; NaN -> 0x7FC0.

    Bit-identical to ``torch.Tensor.to(torch.bfloat16)`` (c10 ``round_to_nearest_even``).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat_in, out = x.reshape(-1), np.empty(x.shape, np.uint16)
    flat_out = out.reshape(-1)
    step = 1 << 20  # in blocks, so the temporaries stay small next to a large tensor
    for start in range(0, flat_in.size, step):
        block = flat_in[start:start + step]
        u = block.view(np.uint32)
        t = u >> np.uint32(16)
        t &= np.uint32(1)
        t += np.uint32(0x7FFF)
        t += u
        t >>= np.uint32(16)
        part = flat_out[start:start + step]
        part[:] = t
        part[np.isnan(block)] = 0x7FC0
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def cast(data: np.ndarray, src: str, dst: Optional[str]) -> np.ndarray:
    """Convert storage array ``data`` of dtype ``src`` to dtype ``dst`` (None or equal: unchanged).

    float <-> float goes through float32 where needed; rounding is round-to-nearest-even like
    ``torch.Tensor.to``. Raises MsllmError for a non-float conversion.
    """
    if dst is None or dst == src:
        return data
    if src not in FLOAT_DTYPES or dst not in FLOAT_DTYPES:
        raise MsllmError(f"cannot convert a {src} tensor to {dst}")
    f32 = bf16_bits_to_f32(data) if src == "bfloat16" else data
    if dst == "bfloat16":
        return f32_to_bf16_bits(f32.astype(np.float32, copy=False))
    with np.errstate(over="ignore"):  # out-of-range values become +-inf, as in torch
        return f32.astype(STORAGE[dst])


def to_float32(data: np.ndarray, dtype: str) -> np.ndarray:
    """Storage array -> float32 (for numerics: verification, comparisons)."""
    return cast(data, dtype, "float32")


def tensor_nbytes(shape: Iterable[int], dtype: str) -> int:
    """Bytes of a tensor of ``shape`` and msllm dtype name ``dtype``."""
    return int(np.prod(tuple(shape), dtype=np.int64)) * np.dtype(STORAGE[dtype]).itemsize


@dataclass
class TensorRef:
    """One tensor of an input file: name, shape and dtype known, data read by ``load()``.

    ``load()`` returns the storage array (see :func:`cast`) of ``shape``; ``where`` names the file
    for messages.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    where: str
    loader: Callable[[], np.ndarray] = field(repr=False)

    def load(self) -> np.ndarray:
        return self.loader()


class OpenFiles:
    """Open file handles shared by the loaders of one conversion; closed by :meth:`close`."""

    def __init__(self):
        self._open: dict[str, object] = {}

    def get(self, path: str):
        if path not in self._open:
            self._open[path] = open(path, "rb")
        return self._open[path]

    def close(self) -> None:
        for fh in self._open.values():
            fh.close()
        self._open.clear()


def read_exact(fh, offset: int, nbytes: int, dtype: str, shape: tuple, where: str, name: str) -> np.ndarray:
    """Read ``nbytes`` at ``offset`` of open file ``fh`` into a new storage array of ``shape``;
    MsllmError naming ``where`` and ``name`` if the file ends early."""
    arr = np.empty(shape, STORAGE[dtype])
    fh.seek(offset)
    got = fh.readinto(memoryview(arr).cast("B")) if nbytes else 0
    if got != nbytes:
        raise MsllmError(f"{where}: tensor {name} is truncated ({got} of {nbytes} bytes)")
    return arr


__all__ = ["DTYPE_ALIASES", "STORAGE", "FLOAT_DTYPES", "normalize_dtype", "f32_to_bf16_bits", "bf16_bits_to_f32",
           "cast", "to_float32", "tensor_nbytes", "TensorRef", "OpenFiles", "read_exact"]
