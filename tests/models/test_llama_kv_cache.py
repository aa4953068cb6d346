"""The key/value cache path (``forward_cached``) against the full causal forward pass: prefill of a
left-padded batch and token-by-token decode give each row the logits the uncached model gives
that row alone, in GRAPH mode (the mode generation compiles) and on both model paths."""

import numpy as np
import pytest
from helpers import context_mode

import mindspore as ms
from mindspore import nn

from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.kv_cache import cache_index, empty_cache
from msllm.models.llama.model import LlamaForCausalLM

SEED = 7
CFG = LlamaConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2,
                  intermediate_size=96, seq_length=32, initializer_range=0.3, rope_theta=500000.0)


class Cached(nn.Cell):
    def __init__(self, net, fresh=False):
        super().__init__()
        self.net = net
        self.fresh = fresh

    def construct(self, ids, positions, kpos, index, caches):
        return self.net.forward_cached(ids, positions, kpos, index, caches, False, self.fresh)


def key_positions(pads, slots):
    """(B, S): slot s of row b holds the token of position s - pads[b]; -1 on the padding."""
    k = np.full((len(pads), slots), -1, np.int32)
    for b, pad in enumerate(pads):
        k[b, pad:] = np.arange(slots - pad)
    return k


@pytest.fixture
def graph_mode():
    """GRAPH_MODE for one test (tests/conftest.py's is per module)."""
    yield from context_mode("graph")


@pytest.mark.parametrize("fresh", [False, True], ids=["prefill_over_buffer", "fresh_prefill"])
@pytest.mark.parametrize("fast", [False, True], ids=["ascend_path", "cpu_fast_path"])
def test_prefill_and_decode_match_the_full_forward(graph_mode, fast, fresh):
    """``fresh``: the prefill attends over its own keys only (the generator's prefill graph); its
    cache writes must still happen, which the decode steps after it check."""
    print("seed", SEED)
    ms.set_seed(SEED)
    net = LlamaForCausalLM(CFG, fast_paths=fast)
    net.set_train(False)
    rng = np.random.default_rng(SEED)
    ids = rng.integers(3, 97, (2, 10)).astype(np.int32)
    full = net(ms.Tensor(ids)).asnumpy()                       # (2, 10, V), no cache, no padding
    slots, prompt = 16, 6
    pads = [0, 2]                                              # row 1 holds 4 prompt tokens
    buf = np.zeros((2, prompt), np.int32)
    pos = np.zeros((2, prompt), np.int32)
    buf[0], pos[0] = ids[0, :6], np.arange(6)
    buf[1, 2:], pos[1, 2:] = ids[1, :4], np.arange(4)
    step = Cached(net)
    caches = ms.mutable(empty_cache(2, CFG.kv_heads, slots, CFG.head_dim, CFG.num_layers))
    logits = Cached(net, fresh)(ms.Tensor(buf), ms.Tensor(pos), ms.Tensor(key_positions(pads, slots)),
                  ms.Tensor(cache_index(np.arange(prompt), 2)), caches)
    logits = logits.asnumpy()
    np.testing.assert_allclose(logits[0], full[0, :6], atol=1e-4)
    np.testing.assert_allclose(logits[1, 2:], full[1, :4], atol=1e-4)
    for k in range(4):                                         # decode: one token per row per step
        slot = prompt + k
        nxt = np.array([[ids[0, 6 + k]], [ids[1, 4 + k]]], np.int32)
        p = np.array([[6 + k], [4 + k]], np.int32)
        out = step(ms.Tensor(nxt), ms.Tensor(p), ms.Tensor(key_positions(pads, slots)),
                   ms.Tensor(cache_index([slot], 2)), caches)
        out = out.asnumpy()
        np.testing.assert_allclose(out[0, 0], full[0, 6 + k], atol=1e-4)
        np.testing.assert_allclose(out[1, 0], full[1, 4 + k], atol=1e-4)
    assert np.abs(full).std() > 0.1  # logits carry signal: a wrong cache would show far above 1e-4


@pytest.mark.parametrize("fast", [False, True], ids=["ascend_path", "cpu_fast_path"])
def test_rows_at_their_own_slots_match_the_full_forward(graph_mode, fast):
    """Continuous batching's cache use (msllm/serving/batch.py): a request prefilled alone into
    row 0 of a 2-row cache decodes a step beside an empty row 1; then a second request is
    prefilled into row 1 (left-padded, its own first real slot) and both decode, each row at its
    own slot and position in the same step. Every logit equals the uncached model's for that
    sequence alone."""
    print("seed", SEED)
    ms.set_seed(SEED)
    net = LlamaForCausalLM(CFG, fast_paths=fast)
    net.set_train(False)
    rng = np.random.default_rng(SEED + 1)
    ids = rng.integers(3, 97, (2, 10)).astype(np.int32)
    full = net(ms.Tensor(ids)).asnumpy()                       # (2, 10, V)
    slots, width = 16, 2
    caches = ms.mutable(empty_cache(width, CFG.kv_heads, slots, CFG.head_dim, CFG.num_layers))
    prefill, step = Cached(net, fresh=True), Cached(net)

    def prefill_row(row, tokens, length):
        pad = length - len(tokens)
        buf = np.zeros((1, length), np.int32)
        buf[0, pad:] = tokens
        pos = np.maximum(np.arange(length) - pad, 0).astype(np.int32)[None]
        out = prefill(ms.Tensor(buf), ms.Tensor(pos), ms.Tensor(key_positions([pad], slots)),
                      ms.Tensor(cache_index(np.arange(length), width, [row])), caches).asnumpy()
        return out[0, pad:]

    np.testing.assert_allclose(prefill_row(0, ids[0, :6], 6), full[0, :6], atol=1e-4)

    def decode(tokens, slot_of, pos_of, pad_of, live):
        kpos = np.full((width, slots), -1, np.int32)              # an empty row sees nothing
        for b in range(width):
            if live[b]:
                kpos[b] = key_positions([pad_of[b]], slots)[0]
        return step(ms.Tensor(np.array(tokens, np.int32)[:, None]), ms.Tensor(np.array(pos_of, np.int32)[:, None]),
                    ms.Tensor(kpos), ms.Tensor(cache_index(np.array(slot_of)[:, None], width)), caches).asnumpy()

    out = decode([ids[0, 6], 0], [6, 0], [6, 0], [0, 0], [True, False])   # row 1 empty: slot 0, all hidden
    np.testing.assert_allclose(out[0, 0], full[0, 6], atol=1e-4)
    np.testing.assert_allclose(prefill_row(1, ids[1, :4], 6), full[1, :4], atol=1e-4)   # slots 2..5 of row 1
    for k in range(3):
        out = decode([ids[0, 7 + k], ids[1, 4 + k]], [7 + k, 6 + k], [7 + k, 4 + k], [0, 2], [True, True])
        np.testing.assert_allclose(out[0, 0], full[0, 7 + k], atol=1e-4)
        np.testing.assert_allclose(out[1, 0], full[1, 4 + k], atol=1e-4)
    assert np.abs(full).std() > 0.1


def test_cache_index_puts_slot_s_of_row_b_at_row_s_times_width_plus_b():
    """Hand-checked: 3 cache rows; slots shared by every row, per row, and for chosen rows."""
    np.testing.assert_array_equal(cache_index([0, 1], 3), [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(cache_index(np.array([[4], [0], [2]]), 3), [[12, 1, 8]])
    np.testing.assert_array_equal(cache_index([5, 6], 3, [2]), [[17], [20]])
    with pytest.raises(ValueError, match="outside 0..2"):
        cache_index([0], 3, [3])
