"""The server's prefix cache store (msllm/serving/prefix_cache.py) and the staged prefill's piece
layout (msllm/serving/staged_prefill.py), without a model: keys chain whole blocks, a lookup
returns the longest stored prefix leaving one token to compute, eviction is least recently used
under the byte cap and takes a prefix's later blocks before its earlier ones; the piece layout
against hand-checked cases."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from msllm.serving.prefix_cache import PrefixCache, block_keys
from msllm.serving.staged_prefill import piece_layout

SEED = 0
B = 4                     # block tokens in these tests
L2, K, D = 2, 1, 2        # (2 * layers, kv heads, head dim) of the fake keys and values


def kv_of(tokens):
    """Fake keys and values that name their token and position: entry [i, j] = token j * 10 + i."""
    t = np.asarray(tokens, np.float32)
    return np.broadcast_to((t[None, :] * 10 + np.arange(L2)[:, None])[:, :, None, None],
                           (L2, len(tokens), K, D)).copy()


BLOCK_BYTES = L2 * B * K * D * 4


def test_block_keys_chain_the_whole_prefix():
    """Key i is sha256(key i-1 + the block's int64 ids), computed here by hand; a prompt differing
    only in its first token shares no key with the other, even for identical later blocks."""
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    k0 = hashlib.sha256(np.array([5, 6, 7, 8], np.int64).tobytes()).digest()
    k1 = hashlib.sha256(k0 + np.array([9, 10, 11, 12], np.int64).tobytes()).digest()
    assert block_keys(toks, B) == [k0, k1]                     # the 9th token is not a whole block
    other = block_keys([4] + toks[1:], B)
    assert not set(other) & {k0, k1}


def test_lookup_reuses_whole_blocks_and_leaves_a_token_to_compute():
    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    a = [int(x) for x in rng.integers(0, 1000, 10)]
    store = PrefixCache(100 * BLOCK_BYTES, B)
    assert store.lookup(a) == (0, None)
    assert store.insert(a, kv_of(a)) == 2                       # 10 tokens: 2 whole blocks
    b = a[:6] + [9999, 9998, 9997]
    p, kv = store.lookup(b)                                     # shares block 0 only
    assert p == 4
    np.testing.assert_array_equal(kv, kv_of(a[:4]))
    p, kv = store.lookup(a[:8])                                 # 2 whole blocks, but 1 token must stay
    assert p == 4
    p, kv = store.lookup(a[:9])
    assert p == 8
    np.testing.assert_array_equal(kv, kv_of(a[:8]))
    assert (store.queried, store.hit) == (10 + 9 + 8 + 9, 0 + 4 + 4 + 8)
    # insert from a later block: only the missing ones are stored, from kv of those tokens
    keys, first = store.missing(b[:8] + [1, 2, 3, 4])
    assert first == 1 and len(keys) == 3
    assert store.insert(b[:8] + [1, 2, 3, 4], kv_of((b[:8] + [1, 2, 3, 4])[4:]), start=1) == 2
    p, kv = store.lookup(b[:8] + [1, 2, 3, 4, 0])
    assert p == 12
    np.testing.assert_array_equal(kv, kv_of(b[:8] + [1, 2, 3, 4]))
    with pytest.raises(ValueError, match="of 3 tokens for 4"):
        store.insert([7] * 8, kv_of([7] * 3), start=1)


def test_lru_eviction_under_the_byte_cap_takes_later_blocks_first():
    store = PrefixCache(3 * BLOCK_BYTES, B)
    a = list(range(100, 112))                                   # 3 blocks: fills the cap
    store.insert(a, kv_of(a))
    assert len(store) == 3 and store.bytes == 3 * BLOCK_BYTES
    c = list(range(200, 204)) + [0]
    store.insert(c, kv_of(c))                                   # 1 block more: one must go
    assert len(store) == 3 and store.evicted == 1
    assert store.lookup(c, count=False)[0] == 4
    assert store.lookup(a + [0], count=False)[0] == 8           # a's last block went, not its first
    # a was used last: the next eviction takes c's block, not a's
    d = list(range(300, 304)) + [0]
    store.insert(d, kv_of(d))
    assert store.lookup(c, count=False)[0] == 0
    assert store.lookup(a + [0], count=False)[0] == 8
    assert store.bytes <= store.capacity
    with pytest.raises(ValueError, match="capacity_bytes"):
        PrefixCache(0)


@pytest.mark.parametrize("n, p, chunk, want", [
    (50, 32, 0, (32, 1, 0, 64, 512)),        # 18 tokens to compute: one 32-token piece ending at slot 64
    (50, 0, 32, (32, 2, 0, 64, 512)),        # chunked from the start: 2 pieces over the 64-slot block
    (2000, 0, 512, (512, 4, 32, 2048, 2048)),  # 4 chunks: the 2016-slot block shifted by 32 to end at 2048
    (2000, 1984, 512, (32, 1, 0, 2016, 2048)),  # a long cached prefix: 16 tokens left
    (600, 64, 0, (1024, 1, 416, 1024, 1024)),  # no cap: one piece of the next power of two
])
def test_piece_layout_hand_checked(n, p, chunk, want):
    e, q, shift, end, slots = got = piece_layout(n, p, chunk)
    assert got == want
    pad = -(-n // 32) * 32 - n
    assert end - q * e <= shift + pad + p             # the pieces reach the first uncached token
    assert end - q * e >= 0 and end <= slots


def test_piece_layout_refuses_bad_arguments():
    with pytest.raises(ValueError, match="0 <= p < n"):
        piece_layout(10, 10, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        piece_layout(100, 0, 100)


def test_a_cached_prefix_is_used_only_when_it_saves_work():
    from msllm.serving.staged_prefill import tokens_computed

    assert tokens_computed(600, 0, 0) == 608                  # whole prefill
    assert tokens_computed(600, 64, 0) == 1024                # 536 left -> a 1024 piece: not worth it
    assert tokens_computed(600, 512, 0) == 128                # 88 left -> a 128 piece
    assert tokens_computed(2000, 0, 512) == 2048              # chunked: 4 x 512
    assert tokens_computed(2000, 1024, 512) == 1024           # 976 left: 2 x 512


@pytest.mark.parametrize("flag, value, message", [
    ("--prefill_chunk_size", "100", "--prefill_chunk_size must be 0 (off) or a positive multiple of 32, got 100"),
    ("--warmup_slots", "1000", "--warmup_slots must be a power of two >= 512, got 1000"),
    ("--prefix_cache_mb", "0", "--prefix_cache_mb must be >= 1, got 0"),
])
def test_serve_refuses_bad_speed_flags_before_loading(flag, value, message):
    """tools/serve.py: one ``error:`` line naming the flag, exit 2, before any model is loaded."""
    import os
    import subprocess
    import sys

    from helpers import REPO

    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "serve.py"), "--config",
                        os.path.join(REPO, "configs", "smollm2", "run_smollm2_135m.yaml"), flag, value],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "error: " + message
