"""Exact all-gather of arbitrary bytes (and JSON) across data-parallel ranks.

MindSpore 2.10's CPU collectives move float32 tensors (shared NOTES: AllGather works, other dtypes
are not supported by every CPU kernel). A float32 holds every integer below 2^24 exactly, so
bytes travel as 16-bit words (each exact in float32), the length as three 16-bit words (exact up
to 2^48 bytes), and a large payload in chunks of at most :data:`CHUNK_WORDS` words per
``AllGather`` call, so no count or index is ever rounded and peak memory stays bounded (4 bytes of
float32 per 2 payload bytes, per chunk, times the world size). Used by predict (results),
evaluation (scores) and the trainer (checkpoint agreement).
"""

from __future__ import annotations

import json

import numpy as np

CHUNK_WORDS = 1 << 22   # 4 Mi 16-bit words = 8 MiB of payload per AllGather call


def _words(n: int) -> np.ndarray:
    return np.array([(n >> s) & 0xFFFF for s in (0, 16, 32)], np.float32)


def _from_words(w) -> int:
    return sum(int(w[k]) << s for k, s in enumerate((0, 16, 32)))


def all_gather_bytes(payload: bytes, world_size: int, gather=None) -> list[bytes]:
    """Every rank's ``payload`` (bytes of any length), in rank order, on every rank.

    Args:
        payload: this rank's bytes.
        world_size: ranks in the group (1: returns ``[payload]`` without communicating).
        gather: the all-gather callable (default ``mindspore.ops.AllGather()``): takes a float32
            Tensor of shape (n,) and returns (world_size * n,).

    Returns:
        list of ``world_size`` bytes objects, bit-identical to what each rank passed.
    """
    if world_size == 1:
        return [bytes(payload)]
    import mindspore as ms

    if gather is None:
        from mindspore import ops

        gather = ops.AllGather()
    data = np.frombuffer(bytes(payload) + b"\0" * (len(payload) % 2), np.uint16)
    sizes = gather(ms.Tensor(_words(len(payload)))).asnumpy().reshape(world_size, 3)
    lengths = [_from_words(row) for row in sizes]
    words = max((n + 1) // 2 for n in lengths)
    out = [np.empty(words, np.uint16) for _ in range(world_size)]
    for start in range(0, max(words, 1), CHUNK_WORDS):
        stop = min(start + CHUNK_WORDS, words)
        if stop <= start:
            break
        piece = np.zeros(stop - start, np.float32)
        mine = data[start:stop]
        piece[:mine.size] = mine
        every = gather(ms.Tensor(piece)).asnumpy().reshape(world_size, stop - start)
        for r in range(world_size):
            out[r][start:stop] = every[r].astype(np.uint16)
    return [out[r].tobytes()[:lengths[r]] for r in range(world_size)]


def all_gather_json(value, world_size: int, gather=None) -> list:
    """Every rank's JSON-able ``value``, in rank order (:func:`all_gather_bytes` of its UTF-8 JSON)."""
    blobs = all_gather_bytes(json.dumps(value).encode("utf-8"), world_size, gather)
    return [json.loads(b.decode("utf-8")) for b in blobs]
