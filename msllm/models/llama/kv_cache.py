"""A key/value cache for incremental decoding, kept beside the attention (litgpt's ``KVCache``).

The cache is functional: each layer's keys and values live in two tensors (B, K, S, D) that the
caller passes in and gets back updated, so one compiled graph serves every decode step (static
shapes: S is the buffer length, fixed for a generation) and the training graph has no cache.

Writing: ``write`` (T, S) is a one-hot matrix, ``write[t, s] = 1`` puts new token t at cache slot s.

* decode (T = 1): one token into slot s, a select over the cache,
  ``cache' = where(write[0, s], new, cache)`` (the masked update MindFormers' ``KVCacheMgr`` uses
  where no fused cache kernel exists, ``mindformers/modules/kvcache_mgr.py``);
* several tokens at any slots (the evaluation scorer writes a continuation after a cached
  prefix): ``cache' = cache * (1 - sum_t write[t, :]) + write^T @ new``, O(T S K D) per layer
  (the masked-add update, written for any number of tokens);
* ``fresh`` (a compile-time constant): a prefill into an empty cache, the T tokens to slots
  0..T-1 (:meth:`msllm.generation.decode.Generator.prefill`): a concatenation,
  ``cache' = concat(new, cache[:, :, T:])``, O(S K D) (with chat's buffer of the whole context,
  8192 slots for SmolLM2, the one-hot matmul was a real share of the time to the first token:
  ``benchmarks/ttft_prefill.py``).

Slot s of the buffer is position ``s - pad`` of a row that was left-padded by ``pad`` slots; the
attention mask, not the cache, hides the pad slots.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops


class KVCache(nn.Cell):
    """Update one layer's cache with new keys or values.

    ``construct(cache, new, write, fresh=False)``:
        cache (B, K, S, D), new (B, K, T, D) in the compute dtype, write (T, S) float32 one-hot,
        ``fresh``: an empty cache filled at slots 0..T-1 (module doc) -> updated cache (B, K, S, D),
        same dtype as ``cache``.
    """

    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul(transpose_a=True)
        self.reduce_sum = ops.ReduceSum(keep_dims=False)
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()
        self.concat = ops.Concat(axis=2)
        self.cast = ops.Cast()

    def construct(self, cache, new, write, fresh=False):
        b, k, s, d = cache.shape
        t = new.shape[2]
        if t == 1:
            # decode: one select over the cache instead of the one-hot matmul and its transposes
            # (measured 23% faster decode at the medium shape, batch 1; benchmarks/decode_speed.py)
            hit = self.reshape(write, (1, 1, s, 1)) > 0.5
            return ops.where(hit, new, cache)
        if fresh:
            new = self.cast(new, cache.dtype)
            if t == s:
                return new                                                       # (B, K, S, D)
            return self.concat((new, cache[:, :, t:, :]))                        # slots 0..T-1, then the rest
        write = self.cast(write, cache.dtype)
        keep = 1.0 - self.reduce_sum(write, 0)                                  # (S,)
        # write^T @ new over the token axis: (T, S)^T x (T, B*K*D) -> (S, B*K*D)
        flat = self.reshape(self.transpose(new, (2, 0, 1, 3)), (t, b * k * d))  # (T, B*K*D)
        placed = self.reshape(self.matmul(write, flat), (s, b, k, d))            # (S, B, K, D)
        placed = self.transpose(placed, (1, 2, 0, 3))                            # (B, K, S, D)
        return cache * self.reshape(keep, (1, 1, s, 1)) + placed


def empty_cache(batch: int, kv_heads: int, length: int, head_dim: int, num_layers: int, dtype=ms.float32):
    """Zero caches for a whole model: a tuple of ``2 * num_layers`` tensors (B, K, S, D), keys and
    values of layer 0, then layer 1, ... (the order ``LlamaForCausalLM.forward_cached`` takes)."""
    import numpy as np

    zeros = np.zeros((batch, kv_heads, length, head_dim), np.float32)
    return tuple(ms.Tensor(zeros, dtype) for _ in range(2 * num_layers))
