"""The server's prefix cache: keys and values of prompt prefixes already computed, keyed by token ids.

Design (vLLM's automatic prefix caching, ``docs/design/prefix_caching.md``): a prompt is cut into
blocks of :data:`BLOCK` tokens; block i's key is a SHA-256 digest of block i - 1's key and block i's
token ids, so a key names the whole prefix up to the end of its block (two prompts share a block
only if every token before it is the same too). A block holds the keys and values of its tokens
at positions ``i * BLOCK .. (i + 1) * BLOCK - 1`` for every layer: one float array
(2 * layers, BLOCK, kv_heads, head_dim), keys then values per layer (the order of
:func:`msllm.models.llama.kv_cache.empty_cache`). A token's key and value depend only on it, its
position and the tokens before it (causal attention; the rotary embedding is applied before the
cache), so a block computed for one request is exact for any prompt with the same prefix.

Only whole blocks of prompts are stored (not the generated tokens: a multi-turn history hits on
the earlier turn's prompt, and its reply is computed again). Eviction is least recently used
over blocks, under a cap in bytes; a lookup or an insertion touches a prefix's blocks from the
last to the first, so a block is always more recent than the blocks after it and eviction takes
leaves first (a block whose parent is gone is unreachable: lookups stop at the first missing key).

Used by the engine's thread only (no locking).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np

BLOCK = 32           # tokens per block: the prompt slot multiple (msllm.generation.passes.SLOT_MULTIPLE)


def block_keys(tokens: Sequence[int], block: int = BLOCK) -> list:
    """SHA-256 digests (bytes) of the whole blocks of ``tokens``: key i covers tokens
    0 .. (i + 1) * ``block`` - 1 (module docstring)."""
    keys, parent = [], b""
    for i in range(len(tokens) // block):
        chunk = np.asarray(tokens[i * block:(i + 1) * block], np.int64).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Blocks of prompt keys and values (module docstring).

    Args:
        capacity_bytes: the most bytes of blocks kept (> 0); a block that alone exceeds it is not stored.
        block: tokens per block.

    Counters (for ``/metrics``): ``queried`` prompt tokens looked up, ``hit`` tokens found.
    """

    def __init__(self, capacity_bytes: int, block: int = BLOCK):
        if capacity_bytes <= 0:
            raise ValueError(f"PrefixCache: capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity, self.block = int(capacity_bytes), int(block)
        self.blocks: OrderedDict = OrderedDict()      # key -> (2L, block, K, D) array; oldest first
        self.bytes = 0
        self.queried = 0
        self.hit = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def _touch(self, keys: list) -> None:
        for k in reversed(keys):        # the first block ends most recent (leaves are evicted first)
            self.blocks.move_to_end(k)

    def lookup(self, tokens: Sequence[int], count: bool = True) -> tuple[int, Optional[np.ndarray]]:
        """The longest stored prefix of ``tokens`` that leaves at least one token to compute (its
        logits give the first new token): (p tokens, keys and values (2L, p, K, D) float32 or None
        when p = 0). ``count``: add to :attr:`queried` / :attr:`hit`."""
        keys = block_keys(tokens[:max(len(tokens) - 1, 0)], self.block)
        found = []
        for k in keys:
            if k not in self.blocks:
                break
            found.append(k)
        p = len(found) * self.block
        if count:
            self.count(len(tokens), p)
        if not found:
            return 0, None
        self._touch(found)
        return p, np.concatenate([self.blocks[k] for k in found], axis=1)

    def count(self, queried: int, hit: int) -> None:
        """Add a lookup of ``queried`` tokens of which ``hit`` were reused to the counters."""
        self.queried += int(queried)
        self.hit += int(hit)

    def missing(self, tokens: Sequence[int]) -> tuple[list, int]:
        """(keys of ``tokens``' whole blocks, index of the first one not stored)."""
        keys = block_keys(tokens, self.block)
        first = 0
        while first < len(keys) and keys[first] in self.blocks:
            first += 1
        return keys, first

    def insert(self, tokens: Sequence[int], kv: np.ndarray, start: int = 0) -> int:
        """Store the whole blocks of ``tokens`` from block ``start`` on, ``kv`` (2L, n', K, D) holding
        the keys and values of tokens ``start * block`` .. (at least to the last whole block);
        evict the least recently used blocks beyond the capacity. Returns blocks added.

        Raises ValueError if ``kv`` covers fewer tokens than those blocks."""
        keys = block_keys(tokens, self.block)
        b = self.block
        need = (len(keys) - start) * b
        if need > 0 and kv.shape[1] < need:
            raise ValueError(f"PrefixCache.insert: keys/values of {kv.shape[1]} tokens for {need}")
        added = 0
        for i in range(start, len(keys)):
            if keys[i] in self.blocks:
                continue
            arr = np.ascontiguousarray(kv[:, (i - start) * b:(i - start + 1) * b], dtype=np.float32)
            if arr.nbytes > self.capacity:
                break
            self.blocks[keys[i]] = arr
            self.bytes += arr.nbytes
            added += 1
        self._touch([k for k in keys if k in self.blocks])
        while self.bytes > self.capacity and self.blocks:
            _, arr = self.blocks.popitem(last=False)
            self.bytes -= arr.nbytes
            self.evicted += 1
        return added


__all__ = ["BLOCK", "PrefixCache", "block_keys"]
