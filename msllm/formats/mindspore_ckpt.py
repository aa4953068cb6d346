"""MindSpore ``.ckpt`` files, read and written one tensor at a time.

Format: protobuf ``Checkpoint { repeated Value value = 1; }``,
``Value { required string tag = 1; TensorProto tensor = 2; }``,
``TensorProto { repeated int64 dims = 1; required string tensor_type = 2; required bytes
tensor_content = 3; }`` (``mindspore/train/checkpoint.proto``; the compiled module ships in the
wheel as ``mindspore/train/checkpoint_pb2.py``). MindSpore's own writer
(``mindspore/train/serialization.py`` ``_exec_save``) appends one serialized ``Checkpoint``
holding one ``Value`` per tensor (per 512 MiB chunk of a tensor); concatenated protobuf
messages parse as one message, so the file can be written and read one tensor at a time.
MindSpore 2.10 has no public streaming writer (``save_checkpoint`` takes the whole list), so
:class:`CkptWriter` / :func:`scan_ckpt` implement that same framing; the tests check the bytes
are identical to ``mindspore.save_checkpoint`` and that ``mindspore.load_checkpoint`` reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from msllm.errors import MsllmError
from msllm.formats.dtypes import STORAGE, OpenFiles, TensorRef, tensor_nbytes

MS_TYPES = {"Float32": "float32", "Float16": "float16", "BFloat16": "bfloat16", "Float64": "float64",
            "Int32": "int32", "Int64": "int64"}
MS_TYPE_OF = {v: k for k, v in MS_TYPES.items()}

CKPT_CHUNK = 512 * 1024 * 1024  # bytes per Value, MindSpore serialization.SLICE_SIZE (KB) * 1024


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(number: int, payload_len: int) -> bytes:
    return _varint((number << 3) | 2) + _varint(payload_len)


class CkptWriter:
    """Write a MindSpore ``.ckpt`` one tensor at a time (see the module docstring for the format).

    ``write(name, data, dtype)``: ``data`` a storage array (:func:`cast`), ``dtype`` its msllm
    dtype name. The bytes equal ``mindspore.save_checkpoint`` of the same tensors in the same
    order (tensors above ``chunk`` bytes are split into consecutive Values like MindSpore's
    ``_write_parameter_bytes_data``). Use as a context manager; the file is closed on exit.
    """

    def __init__(self, path: str, chunk: int = CKPT_CHUNK):
        self.path = path
        self.chunk = chunk
        self._fh = open(path, "wb")

    def write(self, name: str, data: np.ndarray, dtype: str) -> None:
        if dtype not in MS_TYPE_OF:
            raise MsllmError(f"tensor {name}: dtype {dtype} cannot be stored in a .ckpt")
        data = np.ascontiguousarray(data)
        raw = memoryview(data).cast("B") if data.nbytes else memoryview(b"")
        tag = name.encode("utf-8")
        type_name = MS_TYPE_OF[dtype].encode()
        dims = b"".join(b"\x08" + _varint(int(d)) for d in data.shape)
        for start in range(0, max(len(raw), 1), self.chunk):
            part = raw[start:start + self.chunk]
            tensor = dims + _len_field(2, len(type_name)) + type_name
            tensor_len = len(tensor) + len(_len_field(3, len(part))) + len(part)
            value_head = _len_field(1, len(tag)) + tag + _len_field(2, tensor_len)
            value_len = len(value_head) + tensor_len
            self._fh.write(_len_field(1, value_len) + value_head + tensor + _len_field(3, len(part)))
            self._fh.write(part)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class CkptEntry:
    """One tensor of a ``.ckpt``: name, dims, dtype, and its byte ranges in the file."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # msllm dtype name, or the MindSpore type string when not a supported numeric type
    slices: list
    path: str

    def load(self, fh=None) -> np.ndarray:
        """The storage array (see :func:`cast`)."""
        if self.dtype not in STORAGE:
            raise MsllmError(f"{self.path}: entry {self.name} has type {self.dtype}, not a numeric tensor")
        own = fh is None
        fh = fh or open(self.path, "rb")
        try:
            total = sum(n for _, n in self.slices)
            expected = tensor_nbytes(self.shape, self.dtype)
            if total != expected:
                raise MsllmError(f"{self.path}: entry {self.name} holds {total} bytes, its shape "
                                 f"{list(self.shape)} {self.dtype} needs {expected}")
            arr = np.empty(self.shape, STORAGE[self.dtype])
            view, pos = memoryview(arr).cast("B") if expected else memoryview(bytearray()), 0
            for offset, n in self.slices:
                fh.seek(offset)
                if fh.readinto(view[pos:pos + n]) != n:
                    raise MsllmError(f"{self.path}: entry {self.name} is truncated")
                pos += n
            return arr
        finally:
            if own:
                fh.close()


class _Reader:
    def __init__(self, fh, path):
        self.fh, self.path = fh, path

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.fh.read(1)
            if not b:
                raise MsllmError(f"{self.path}: not a MindSpore checkpoint (truncated protobuf)")
            result |= (b[0] & 0x7F) << shift
            if not b[0] & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise MsllmError(f"{self.path}: not a MindSpore checkpoint (bad varint)")

    def fields(self, end: int):
        """Yield (field number, wire type, value) up to byte ``end``; for length-delimited
        fields value = (offset, length) and the caller must leave the file at offset + length."""
        while self.fh.tell() < end:
            key = self.varint()
            number, wire = key >> 3, key & 7
            if wire == 0:
                yield number, wire, self.varint()
            elif wire == 2:
                n = self.varint()
                off = self.fh.tell()
                if off + n > end:
                    raise MsllmError(f"{self.path}: not a MindSpore checkpoint (field runs past its message)")
                yield number, wire, (off, n)
            elif wire == 1:
                yield number, wire, self.fh.read(8)
            elif wire == 5:
                yield number, wire, self.fh.read(4)
            else:
                raise MsllmError(f"{self.path}: not a MindSpore checkpoint (wire type {wire})")


def scan_ckpt(path: str) -> dict[str, CkptEntry]:
    """Index a MindSpore ``.ckpt`` without reading tensor data: ``{name: CkptEntry}`` in file order.

    Consecutive Values with the same tag are one tensor (MindSpore's chunking). A trailing
    ``crc_num`` record (``save_checkpoint(crc_check=True)``) is skipped. Raises MsllmError naming
    the file if it is missing or is not an unencrypted MindSpore checkpoint.
    """
    if not os.path.isfile(path):
        raise MsllmError(f"{path}: checkpoint file not found")
    size = os.path.getsize(path)
    entries: dict[str, CkptEntry] = {}
    last = None
    with open(path, "rb") as fh:
        end = size
        if size >= 17:
            fh.seek(size - 17)
            if fh.read(7) == b"crc_num":
                end = size - 17
            fh.seek(0)
        r = _Reader(fh, path)
        for number, wire, val in r.fields(end):
            if number != 1 or wire != 2:
                raise MsllmError(f"{path}: not a MindSpore checkpoint (unexpected field {number})")
            v_off, v_len = val
            tag, dims, type_name, content = None, [], None, None
            for f2, w2, val2 in r.fields(v_off + v_len):
                if f2 == 1 and w2 == 2:
                    tag = fh.read(val2[1]).decode("utf-8", "replace")
                elif f2 == 2 and w2 == 2:
                    t_off, t_len = val2
                    for f3, w3, val3 in r.fields(t_off + t_len):
                        if f3 == 1 and w3 == 0:
                            dims.append(val3 - (1 << 64) if val3 >= 1 << 63 else val3)
                        elif f3 == 1 and w3 == 2:  # packed dims
                            stop = val3[0] + val3[1]
                            while fh.tell() < stop:
                                dims.append(r.varint())
                        elif f3 == 2 and w3 == 2:
                            type_name = fh.read(val3[1]).decode("utf-8", "replace")
                        elif f3 == 3 and w3 == 2:
                            content = val3
                            fh.seek(val3[0] + val3[1])
                        elif w3 == 2:
                            fh.seek(val3[0] + val3[1])
                elif f2 == 3:
                    raise MsllmError(f"{path}: entry {tag} is a MapParameter, which msllm does not convert")
                elif w2 == 2:
                    fh.seek(val2[0] + val2[1])
            if tag is None or type_name is None or content is None:
                raise MsllmError(f"{path}: not a MindSpore checkpoint (a value lacks its tag, type or data)")
            if tag == last:
                entries[tag].slices.append(content)
            else:
                if tag in entries:
                    raise MsllmError(f"{path}: entry {tag} appears twice")
                dtype = MS_TYPES.get(type_name, type_name)
                shape = () if dims == [0] else tuple(dims)  # MindSpore's loader reads dims [0] as a scalar
                entries[tag] = CkptEntry(tag, shape, dtype, [content], path)
            last = tag
    return entries


def scan_checkpoint(path: str) -> dict[str, TensorRef]:
    """``{name: TensorRef}`` of a MindSpore checkpoint: ``.ckpt``, or ``.safetensors`` as the
    trainer writes with ``format: safetensors``; tensor data read on ``load()``."""
    if path.endswith(".safetensors"):
        from msllm.formats.safetensors import safetensors_refs

        if not os.path.isfile(path):
            raise MsllmError(f"{path}: checkpoint file not found")
        return safetensors_refs(path, OpenFiles())
    return {name: TensorRef(name, e.shape, e.dtype, path, e.load) for name, e in scan_ckpt(path).items()}


__all__ = ["CKPT_CHUNK", "CkptWriter", "CkptEntry", "scan_ckpt", "scan_checkpoint", "MS_TYPES"]
