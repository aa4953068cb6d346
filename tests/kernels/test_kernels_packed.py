"""msllm's CPU flash kernel on packed rows (``flash_attention_docs``): block-diagonal causal
attention against a float64 numpy reference written from the rule's statement (query t sees key
s iff both lie in the same document and s <= t, and t - W < s with a window W), and gradients
against MindSpore's automatic differentiation of the composed operators under the same mask.

Documents are given as lengths; they end inside the kernel's 64- and 128-row query blocks, span
several blocks, and are followed by padding (a segment of its own, as MindFormers' positions
treat it). Tolerance as tests/kernels/test_kernels_ops.py: 1e-5 relative to the largest value."""

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, ops

from test_kernels_ops import close, grads, t

SEED = 20261127


def doc_starts(lengths, tq):
    """(T,) start slot of each slot's document (the padding after the last one: its own)."""
    start = np.zeros(tq, np.int64)
    s = 0
    for n in lengths:
        start[s:s + n] = s
        s += n
    start[s:] = s
    return start


def seen(lengths, tq, window):
    """(T, T) bool from the rule, element by element."""
    start = doc_starts(lengths, tq)
    out = np.zeros((tq, tq), bool)
    for qi in range(tq):
        for ki in range(tq):
            out[qi, ki] = start[ki] == start[qi] and ki <= qi and (window == 0 or ki > qi - window)
    return out


def attention_numpy(q, k, v, vis):
    """softmax(q k^T / sqrt(D)) v over the visible keys, float64; vis (B, T, T)."""
    b, tq, h, d = q.shape
    rep = h // k.shape[2]
    kk, vv = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
    s = np.where(vis[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = np.log(p.sum(-1)) + m[..., 0]
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vv), lse


def attention_composed(q, k, v, vis):
    b, tq, h, d = q.shape
    rep = h // k.shape[2]
    qq = ops.transpose(q, (0, 2, 1, 3))
    kk = ops.repeat_interleave(ops.transpose(k, (0, 2, 1, 3)), rep, 1)
    vv = ops.repeat_interleave(ops.transpose(v, (0, 2, 1, 3)), rep, 1)
    s = ops.matmul(qq, ops.transpose(kk, (0, 1, 3, 2))) / np.sqrt(d)
    s = s + Tensor(np.where(vis[:, None], 0.0, -1e9).astype(np.float32))
    return ops.transpose(ops.matmul(ops.softmax(s, -1), vv), (0, 2, 1, 3))


CASES = {
    # rows' document lengths (B rows), T, H, K, D, window
    "ends-inside-64-blocks": ([[10, 50, 30, 5], [64, 64, 2]], 140, 4, 2, 16, 0),
    "one-document-is-causal": ([[70]], 70, 2, 1, 16, 0),
    "padding-tail": ([[3, 1, 20], [1]], 40, 2, 2, 8, 0),
    "128-row-blocks": ([[300, 129, 200, 100, 70]], 800, 2, 1, 16, 0),
    "window-inside-documents": ([[40, 90, 13], [7, 120]], 150, 4, 2, 16, 24),
    "d64-gqa": ([[33, 97, 60]], 200, 6, 2, 64, 0),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_flash_attention_docs_is_block_diagonal_causal(kernels, pynative, case):
    rows, tq, h, kv, d, window = CASES[case]
    print("seed", SEED)
    r = np.random.default_rng(SEED)
    b = len(rows)
    q, k, v = (r.standard_normal((b, tq, n, d)) for n in (h, kv, kv))
    dy = r.standard_normal((b, tq, h, d))
    start = np.stack([doc_starts(lengths, tq) for lengths in rows]).astype(np.float32)
    vis = np.stack([seen(lengths, tq, window) for lengths in rows])
    w = kernels.window_tensor(window)
    out, lse = kernels.flash_attention_docs(t(q), t(k), t(v), w, Tensor(start))
    ref, ref_lse = attention_numpy(q, k, v, vis)
    close(out.asnumpy(), ref)
    close(lse.asnumpy(), ref_lse)
    got = grads(lambda *x: kernels.flash_attention_docs(*x, w, Tensor(start))[0], (t(q), t(k), t(v)), t(dy))
    want = grads(lambda *x: attention_composed(*x, vis), (t(q), t(k), t(v)), t(dy))
    for g, e in zip(got, want):
        close(g, e)


def test_a_document_ignores_the_others(kernels, pynative):
    """Changing document 1's keys and values leaves documents 0 and 2 bit-identical, and a row
    holding one document gives what the unpacked kernel gives for it alone."""
    print("seed", SEED)
    r = np.random.default_rng(SEED)
    lengths, tq = [50, 80, 30], 160
    q, k, v = (r.standard_normal((1, tq, 2, 16)) for _ in range(3))
    start = Tensor(doc_starts(lengths, tq)[None].astype(np.float32))
    w = kernels.window_tensor(None)
    a = kernels.flash_attention_docs(t(q), t(k), t(v), w, start)[0].asnumpy()
    k2, v2 = k.copy(), v.copy()
    k2[:, 50:130], v2[:, 50:130] = r.standard_normal((1, 80, 2, 16)), r.standard_normal((1, 80, 2, 16))
    c = kernels.flash_attention_docs(t(q), t(k2), t(v2), w, start)[0].asnumpy()
    np.testing.assert_array_equal(a[:, :50], c[:, :50])
    np.testing.assert_array_equal(a[:, 130:], c[:, 130:])
    assert np.abs(a[:, 50:130] - c[:, 50:130]).max() > 1e-2
    alone = kernels.flash_attention(t(q[:, 50:130]), t(k[:, 50:130]), t(v[:, 50:130]), w)[0].asnumpy()
    close(a[:, 50:130], alone)
