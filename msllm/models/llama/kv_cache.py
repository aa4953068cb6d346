"""A key/value cache for incremental decoding, kept beside the attention (litgpt's ``KVCache``).

Each layer's keys and values live in two ``mindspore.Parameter`` buffers (S * B, K, D) that the
caller allocates (:func:`empty_cache`), passes into the compiled step and keeps: the step writes
the new tokens' keys and values into them **in place** (``ScatterUpdate`` of rows along the
first axis, a side effect MindSpore orders before the attention's read of the same buffer),
so one compiled graph serves every decode step (static shapes: S is the buffer length, fixed for
a generation) and a step costs O(T B K D) for the write, not a rewrite of the whole buffer. This
is the design of MindFormers' ``KVCacheMgr`` (``mindformers/modules/kvcache_mgr.py``:
``key_past`` / ``value_past`` Parameters updated by in-place cache operators).

Why this layout and operator, measured (MindSpore 2.10 CPU, SmolLM2's 30 layers at batch 8 with
544 slots, 60 writes of one slot per decode step; BENCHMARKS.md "decode step"):

* msllm's first cache was functional, a ``select`` over the whole (B, K, S, D) buffer per layer
  returned as a new tensor: 33 ms of a 150 ms step;
* ``ScatterNdUpdate`` into a (B, K, S, D) Parameter copies the whole buffer before writing on
  CPU: 15 ms for the 60 writes;
* ``ScatterUpdate`` of slot rows into an (S, B, K, D) Parameter writes in place: 3 ms, and that
  includes reading back one element of each buffer.

Slots first also means a slot of every row is one contiguous (B, K, D) block. The Parameters are
**flat**, (S * B, K, D): cache row ``s * B + b`` holds slot s of batch row b (the same memory as
(S, B, K, D)), because ``ScatterUpdate`` writes whole rows of its first axis: with the slot and the
batch row in one axis, every batch row can write its own slot in the same call. Writing: ``index``
(T, B) int32, the cache row of new token t of batch row b (:func:`cache_index`): a prefill of
left-padded rows writes slots 0..T-1 of every row, a decode step one slot per row (the same slot in
a static batch; each row its own in the serving engine's continuous batch, where rows start and
finish at different steps), a prefill of one new request the rows of its own batch row only, the
evaluation scorer a continuation after a cached prefix. The attention reads the flat buffer
directly in msllm's decode kernel and through :meth:`KVCache.heads_first`, a (B, K, S, D) copy,
on the composed path.
"""

from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import Parameter, nn, ops


class KVCache(nn.Cell):
    """Write one layer's new keys or values into its cache, in place.

    ``construct(cache, new, index)``:
        cache (S * B, K, D) Parameter, new (T, B', K, D) (cast to the cache's dtype), index (T, B')
        int32 cache rows (:func:`cache_index`; B' <= B) -> the cache after the write (the same
        Parameter: later reads of it in the graph see the new slots).
    """

    def __init__(self):
        super().__init__()
        self.scatter = ops.ScatterUpdate()
        self.cast = ops.Cast()
        self.transpose = ops.Transpose()

        self.reshape = ops.Reshape()

    def construct(self, cache, new, index):
        return ops.depend(cache, self.scatter(cache, index, self.cast(new, cache.dtype)))

    def heads_first(self, cache, batch: int):
        """(S * B, K, D) with B = ``batch`` -> (B, K, S, D), the composed attention's layout (a copy)."""
        rows, k, d = cache.shape
        return self.transpose(self.reshape(cache, (rows // batch, batch, k, d)), (1, 2, 0, 3))


def cache_index(slots, width: int, rows=None) -> np.ndarray:
    """(T, B) int32 cache rows for the flat caches of ``width`` batch rows: ``slots`` (T,) (the same
    slots in every row) or (B, T) (each row its own), written by batch rows ``rows`` (B,) (default
    0..width-1) -> ``slot * width + row``.

    Raises ValueError if a slot is negative or a row is outside 0..width-1."""
    slots = np.asarray(slots, np.int64)
    rows = np.arange(width) if rows is None else np.asarray(rows, np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= width):
        raise ValueError(f"cache_index: rows {rows.tolist()} outside 0..{width - 1}")
    if slots.size and slots.min() < 0:
        raise ValueError("cache_index: a negative slot")
    per_row = slots.T if slots.ndim == 2 else np.broadcast_to(slots[:, None], (slots.shape[0], rows.size))
    return (per_row * width + rows[None, :]).astype(np.int32)


def as_cache(tensors) -> tuple:
    """Tensors (S * B, K, D) -> a tuple of cache Parameters holding them (e.g. a prefix's cache
    repeated over a batch, which the batch then writes into without changing the prefix's own)."""
    return tuple(Parameter(t, name=f"kv_cache_{i}", requires_grad=False) for i, t in enumerate(tensors))


def empty_cache(batch: int, kv_heads: int, length: int, head_dim: int, num_layers: int, dtype=ms.float32,
                name: str = "kv_cache_"):
    """Zero caches for a whole model: a tuple of ``2 * num_layers`` Parameters (S * B, K, D) named
    ``name`` + their index, with S = ``length`` slots and B = ``batch`` rows, keys and values of layer
    0, then layer 1, ... (the order ``LlamaForCausalLM.forward_cached`` takes); pass them as
    ``ms.mutable(caches)`` (otherwise GRAPH_MODE treats them as constants), or hold them in a cell
    (:mod:`msllm.generation.bound_caches`)."""
    zeros = np.zeros((length * batch, kv_heads, head_dim), np.float32)
    return tuple(Parameter(ms.Tensor(zeros, dtype), name=f"{name}{i}", requires_grad=False)
                 for i in range(2 * num_layers))
