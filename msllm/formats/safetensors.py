"""safetensors files, read by header and written one tensor at a time.

Format (``huggingface/safetensors`` README, "Format"): 8-byte little-endian header length N,
N bytes of JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}`` (offsets relative to the end of the header), then the byte buffer.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from msllm.errors import MsllmError
from msllm.formats.dtypes import STORAGE, OpenFiles, TensorRef, read_exact, tensor_nbytes

ST_CODES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I32": "int32",
            "I64": "int64"}
ST_CODE_OF = {v: k for k, v in ST_CODES.items()}


def read_safetensors_header(path: str) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int, int]], dict]:
    """Parse the header of safetensors file ``path``.

    Returns ``(data_start, {name: (dtype, shape, begin, end)}, metadata)`` with absolute byte
    offsets ``begin``/``end`` and msllm dtype names. Raises MsllmError naming the file (and the
    tensor) for a truncated file, a header that is not JSON, an unsupported dtype, or offsets that
    disagree with the shape or run past the end of the file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise MsllmError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise MsllmError(f"{path}: not a safetensors file (header length {n} does not fit in {size} bytes)")
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MsllmError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise MsllmError(f"{path}: safetensors header is not a JSON object")
    start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    out = {}
    for name, info in header.items():
        try:
            code, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise MsllmError(f"{path}: tensor {name}: malformed safetensors header entry {info!r}") from None
        if code not in ST_CODES:
            raise MsllmError(f"{path}: tensor {name} has dtype {code}; supported: {sorted(ST_CODES)}")
        dtype = ST_CODES[code]
        if end - begin != tensor_nbytes(shape, dtype) or begin < 0 or start + end > size:
            raise MsllmError(f"{path}: tensor {name}: data_offsets {[begin, end]} do not match shape "
                             f"{list(shape)} {code} or run past the end of the file ({size} bytes)")
        out[name] = (dtype, shape, start + begin, start + end)
    return start, out, metadata


def safetensors_refs(path: str, files: Optional[OpenFiles] = None) -> dict[str, TensorRef]:
    """``{name: TensorRef}`` of safetensors file ``path`` in header order; data is read on
    ``load()`` through ``files`` (a fresh :class:`OpenFiles` if None)."""
    files = files if files is not None else OpenFiles()
    _, entries, _ = read_safetensors_header(path)
    refs = {}
    for name, (dtype, shape, begin, end) in entries.items():
        def load(path=path, name=name, dtype=dtype, shape=shape, begin=begin, end=end):
            return read_exact(files.get(path), begin, end - begin, dtype, shape, path, name)
        refs[name] = TensorRef(name, shape, dtype, path, load)
    return refs


class SafetensorsWriter:
    """Write a safetensors file whose tensor list is known in advance, one tensor at a time.

    ``specs``: [(name, dtype, shape)] in file order; ``write(name, data)`` must follow that order
    with storage arrays of the declared dtype and shape. ``metadata`` goes to ``__metadata__``
    (transformers requires ``{"format": "pt"}``). The header is padded with spaces to a multiple of
    8 bytes, as the reference implementation does.
    """

    def __init__(self, path: str, specs: list, metadata: Optional[dict] = None):
        self.path = path
        self.specs = list(specs)
        header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
        for name, dtype, shape in self.specs:
            n = tensor_nbytes(shape, dtype)
            header[name] = {"dtype": ST_CODE_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)
        self._fh = open(path, "wb")
        self._fh.write(len(blob).to_bytes(8, "little") + blob)
        self._next = 0

    def write(self, name: str, data: np.ndarray) -> None:
        exp_name, dtype, shape = self.specs[self._next]
        if name != exp_name or tuple(data.shape) != tuple(shape) or data.dtype != STORAGE[dtype]:
            raise ValueError(f"{self.path}: expected {exp_name} {list(shape)} {dtype}, got {name} "
                             f"{list(data.shape)} {data.dtype}")
        data = np.ascontiguousarray(data)
        if data.nbytes:
            self._fh.write(memoryview(data).cast("B"))
        self._next += 1

    def close(self) -> None:
        self._fh.close()
        if self._next != len(self.specs):
            raise ValueError(f"{self.path}: {len(self.specs) - self._next} tensor(s) were not written")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self._fh.close()


__all__ = ["ST_CODES", "read_safetensors_header", "safetensors_refs", "SafetensorsWriter"]
