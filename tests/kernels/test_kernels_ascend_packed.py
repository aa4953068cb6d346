"""Packed rows on Ascend: the model's FlashAttentionScore in layout "TND" with ``actual_seq_qlen`` /
``actual_seq_kvlen`` (the batch's B*T tokens one after another, cumulative document ends), checked
offline like tests/kernels/test_kernels_ascend_wiring.py: a numpy stand-in of the primitive's
DOCUMENTED semantics replaces it, and the model must give the composed path's packed logits.

Documented semantics (mindspore 2.10 ``FlashAttentionScore`` docstring, gen_ops_prim.py): TND =
(T, N, D); ``actual_seq_qlen`` / ``actual_seq_kvlen``: "array with increasing values and the last
value equal to T1 / T2", sequence i being tokens [len[i-1], len[i]); within a sequence the
sparse_mode applies as in BNSD (3 = "rightDownCausal": key j <= query i + S2 - S1 with the
compressed (2048, 2048) mask; 4 = "band"). A repeated value is an empty sequence (MindFormers pads
``actual_seq_len`` with seq_length and passes it as it is). MindFormers' LLaMA uses exactly this
(use_eod_attn_mask_compression: input_layout TND, sparse_mode 3, actual_seq_qlen = actual_seq_kvlen
= actual_seq_len).
"""

import dataclasses

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from test_kernels_ascend_wiring import LAYOUTS, flash_attention_score, small

from msllm.kernels import select
from msllm.models.llama.model import LlamaForCausalLM

SEED = 20261127


class TndStandIn:
    """The primitive in TND with per-sequence lengths, by its documented semantics (float64)."""

    def __init__(self, prim):
        self.prim, self.calls = prim, 0
        self.ignore_lengths = False   # negative control: one sequence over the whole batch

    def __call__(self, query, key, value, real_shift=None, drop_mask=None, padding_mask=None, attn_mask=None,
                 prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
        p = self.prim
        assert LAYOUTS.get(p.input_layout) is None and p.sparse_mode in (3, 4)
        assert query.dtype in (ms.float16, ms.bfloat16) and attn_mask.dtype == ms.uint8
        q, k, v = (x.asnumpy().astype(np.float64) for x in (query, key, value))
        qlen = np.asarray(actual_seq_qlen.asnumpy(), np.int64)
        kvlen = np.asarray(actual_seq_kvlen.asnumpy(), np.int64)
        assert qlen[-1] == q.shape[0] and kvlen[-1] == k.shape[0] and np.all(np.diff(qlen) >= 0)
        if self.ignore_lengths:
            qlen, kvlen = qlen[-1:], kvlen[-1:]
        out = np.zeros_like(q)
        q0 = k0 = 0
        for qe, ke in zip(qlen, kvlen):
            if qe > q0:
                # one sequence: the BNSD rule on (1, N, S, D)
                seq = [x.transpose(1, 0, 2)[None] for x in (q[q0:qe], k[k0:ke], v[k0:ke])]
                o = flash_attention_score(*seq, attn_mask.asnumpy(), p.head_num, p.scale_value, "BNSD",
                                          3 if p.sparse_mode == 3 else 4, p.pre_tokens, p.next_tokens)
                out[q0:qe] = o[0].transpose(1, 0, 2)
            q0, k0 = qe, ke
        self.calls += 1
        dummy = Tensor(np.zeros(1, np.float32))
        return dummy, dummy, dummy, Tensor(out.astype(np.float32), query.dtype)


def test_sparse_mode_3_is_causal_for_equal_lengths():
    """The reference's mode 3 within a sequence of S1 = S2 is the causal rule (j <= i)."""
    from test_kernels_ascend_wiring import flash_attention_score as fas

    r = np.random.default_rng(SEED)
    q, k, v = (r.standard_normal((1, 2, 9, 16)) for _ in range(3))
    mask = np.triu(np.ones((2048, 2048), np.uint8), 1)
    np.testing.assert_allclose(fas(q, k, v, mask, 2, 0.25, "BNSD", 3), fas(q, k, v, mask, 2, 0.25, "BNSD", 2))


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
def test_model_packed_rows_through_flash_attention_score_tnd(pynative, window):
    print("seed", SEED)
    ms.set_seed(SEED)
    base = small(compute_dtype="float16", sliding_window=window)
    fa = LlamaForCausalLM(dataclasses.replace(base, use_flash_attention=True, fused_rms_norm=False), fast_paths=False)
    assert fa.kernels.attention == select.ASCEND_FLASH
    composed = LlamaForCausalLM(dataclasses.replace(base, use_flash_attention=False, fused_rms_norm=False),
                                fast_paths=False)
    ms.load_param_into_net(composed, {p.name: p for p in fa.trainable_params()})
    stand_ins = []
    for layer in fa.model.layers:
        p = layer.self_attn.fa_tnd
        assert p.sparse_mode == (4 if window else 3) and p.head_num == 4 and p.scale_value == 0.25
        if window:
            assert (p.pre_tokens, p.next_tokens) == (window - 1, 0)
        layer.self_attn.fa_tnd = TndStandIn(p)
        stand_ins.append(layer.self_attn.fa_tnd)
    t = 20
    ids = Tensor(np.random.default_rng(SEED).integers(3, 97, (2, t)).astype(np.int32))
    ends = Tensor(np.array([[6, 13, 20, 20], [9, 17, 20, 20]], np.int32))   # row 1: a padding tail
    got = fa(ids, None, ends).asnumpy()
    want = composed(ids, None, ends).asnumpy()
    assert all(s.calls == 1 for s in stand_ins)
    err = np.abs(got - want).max()
    assert err <= 2e-2 * np.abs(want).max(), err
    for s in stand_ins:
        s.ignore_lengths = True
    wrong = fa(ids, None, ends).asnumpy()
    print("max |logit diff| vs composed", err, "| one sequence per batch", np.abs(wrong - want).max())
    assert np.abs(wrong - want).max() > 10 * err
