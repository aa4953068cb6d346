"""The key/value cache path (``forward_cached``) against the full causal forward pass: prefill of a
left-padded batch and token-by-token decode give each row the logits the uncached model gives
that row alone, in GRAPH mode (the mode generation compiles) and on both model paths."""

import numpy as np
import pytest
from helpers import context_mode

import mindspore as ms
from mindspore import nn

from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.kv_cache import empty_cache
from msllm.models.llama.model import LlamaForCausalLM

SEED = 7
CFG = LlamaConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2,
                  intermediate_size=96, seq_length=32, initializer_range=0.3, rope_theta=500000.0)


class Cached(nn.Cell):
    def __init__(self, net, fresh=False):
        super().__init__()
        self.net = net
        self.fresh = fresh

    def construct(self, ids, positions, mask, index, caches):
        return self.net.forward_cached(ids, positions, mask, index, caches, False, self.fresh)


def additive_mask(pads, query_slots, slots):
    """(B, 1, Tq, S): query at slot q of row b sees slots pads[b]..q."""
    m = np.full((len(pads), 1, len(query_slots), slots), -1e9, np.float32)
    for b, pad in enumerate(pads):
        for i, q in enumerate(query_slots):
            m[b, 0, i, pad:q + 1] = 0.0
    return m


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
    logits = Cached(net, fresh)(ms.Tensor(buf), ms.Tensor(pos), ms.Tensor(additive_mask(pads, range(prompt), slots)),
                  ms.Tensor(np.arange(prompt, dtype=np.int32)), caches)
    logits = logits.asnumpy()
    np.testing.assert_allclose(logits[0], full[0, :6], atol=1e-4)
    np.testing.assert_allclose(logits[1, 2:], full[1, :4], atol=1e-4)
    for k in range(4):                                         # decode: one token per row per step
        slot = prompt + k
        nxt = np.array([[ids[0, 6 + k]], [ids[1, 4 + k]]], np.int32)
        p = np.array([[6 + k], [4 + k]], np.int32)
        out = step(ms.Tensor(nxt), ms.Tensor(p), ms.Tensor(additive_mask(pads, [slot], slots)),
                   ms.Tensor(np.array([slot], np.int32)), caches)
        out = out.asnumpy()
        np.testing.assert_allclose(out[0, 0], full[0, 6 + k], atol=1e-4)
        np.testing.assert_allclose(out[1, 0], full[1, 4 + k], atol=1e-4)
    assert np.abs(full).std() > 0.1  # logits carry signal: a wrong cache would show far above 1e-4
