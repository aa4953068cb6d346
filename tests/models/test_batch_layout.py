"""The one owner of the batch layout (msllm.models.llama.batch_layout): its in-graph mask against a
float64 numpy reference written from the rule's statement (tests/helpers/tables.py) for every
layout the callers use, its host-side helpers against hand-checked values, and a check that no
other module keeps its own copy of the rule."""

import os
import re

import numpy as np
import pytest
from helpers.tables import reference_mask

import mindspore as ms
from mindspore import nn

from msllm.models.llama.batch_layout import (HIDDEN, MASKED, additive_mask, causal_positions, document_layout,
                                             document_mask, document_targets, host_additive_mask, key_positions,
                                             left_pad, positions_for)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Mask(nn.Cell):
    def __init__(self, window):
        super().__init__()
        self.window = window

    def construct(self, kpos, qpos):
        return additive_mask(kpos, qpos, self.window, ms.float32)


def graph_mask(kpos, qpos, window):
    return Mask(window)(ms.Tensor(np.asarray(kpos, np.int32)), ms.Tensor(np.asarray(qpos, np.int32))).asnumpy()


def layouts():
    """(name, key positions (B, S), query positions (B, T)) of each caller's layout."""
    pads = np.array([0, 3, 5])
    prompt = 8
    yield "causal training row", np.arange(12)[None], np.arange(12)[None]
    yield "left-padded prefill", key_positions(pads, 16), positions_for(pads, np.arange(prompt))
    yield "decode step", key_positions(pads, 16), positions_for(pads, np.array([prompt + 2]))
    # the serving batch: each row at its own slot, an empty row (negative pad) sees nothing
    row_pads, slots = np.array([2, -1, 0]), np.array([[9], [0], [4]])
    yield "flat serving rows", key_positions(row_pads, 16), positions_for(row_pads, slots)
    # evaluation's shared prefix: slot = position, suffix queries after a 10-token prefix
    yield "cached prefix + suffix", np.arange(24)[None], np.arange(10, 18)[None].repeat(2, 0)


@pytest.mark.parametrize("window", [None, 1, 3, 64], ids=["causal", "window1", "window3", "window_wider"])
@pytest.mark.parametrize("layout", list(layouts()), ids=lambda x: x[0] if isinstance(x, tuple) else None)
def test_graph_mask_equals_the_float64_reference(layout, window):
    _, kpos, qpos = layout
    got = graph_mask(kpos, qpos, window)
    ref = reference_mask(kpos, qpos, window)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got == 0, ref == 0)
    assert np.all(got[ref != 0] == np.float32(MASKED))
    assert (ref == 0).any() and (ref != 0).any()          # both kinds of entry occur


@pytest.mark.parametrize("window", [None, 1, 3, 64], ids=["causal", "window1", "window3", "window_wider"])
@pytest.mark.parametrize("layout", list(layouts()), ids=lambda x: x[0] if isinstance(x, tuple) else None)
def test_host_mask_equals_the_float64_reference_and_the_graph(layout, window):
    """The host form of the rule (the direct decode step's) gives the graph's values, float32 bit for bit."""
    _, kpos, qpos = layout
    got = host_additive_mask(kpos.astype(np.int32), qpos.astype(np.int32), window)
    ref = reference_mask(kpos, qpos, window)
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(got == 0, ref == 0)
    np.testing.assert_array_equal(got.view(np.uint32), graph_mask(kpos, qpos, window).view(np.uint32))


def test_per_layer_windows_are_one_mask_each():
    """A model whose layers have different windows (Qwen2's max_window_layers, Gemma 2's
    alternate layers) builds one mask per distinct window, and layer i reads its own."""
    from msllm.models.llama.config import LlamaConfig
    from msllm.models.llama.model import LlamaModel

    class Alternating(LlamaConfig):
        def layer_window(self, layer):
            return 4 if layer % 2 else None

    cfg = Alternating(vocab_size=32, hidden_size=32, num_layers=3, num_heads=2, intermediate_size=48,
                      seq_length=16)
    model = LlamaModel(cfg)
    assert model.windows == (None, 4) and model.mask_of == (0, 1, 0)
    pos = np.arange(10)[None]
    masks = [m.asnumpy() for m in model.masks(ms.Tensor(pos.astype(np.int32)), ms.Tensor(pos.astype(np.int32)))]
    for w, m in zip(model.windows, masks):
        np.testing.assert_array_equal(m == 0, reference_mask(pos, pos, w) == 0)


def test_host_helpers_hand_checked():
    ids, pads = left_pad([[5, 6, 7], [8]], 4, 0)
    np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 8]])
    np.testing.assert_array_equal(pads, [1, 3])
    np.testing.assert_array_equal(positions_for(pads, np.arange(5)), [[0, 0, 1, 2, 3], [0, 0, 0, 0, 1]])
    np.testing.assert_array_equal(key_positions(np.array([1, -1]), 4), [[HIDDEN, 0, 1, 2], [HIDDEN] * 4])
    with pytest.raises(ValueError, match="does not fit"):
        left_pad([[1, 2, 3]], 2, 0)


def test_causal_positions_in_graph():
    class Pos(nn.Cell):
        def construct(self, x):
            return causal_positions(x.shape[1])

    np.testing.assert_array_equal(Pos()(ms.Tensor(np.zeros((1, 6), np.int32))).asnumpy(), [np.arange(6)])


def test_no_other_module_keeps_its_own_mask_rule():
    """The rule's old copies (issue #31: model.py's causal_mask, decode.py's mask_for, the serving
    batch's inline mask, scoring's NEG) are gone: no module but batch_layout defines the masked
    value or builds an additive mask."""
    offenders = []
    for base, _, files in os.walk(os.path.join(ROOT, "msllm")):
        for f in files:
            if not f.endswith(".py") or f == "batch_layout.py":
                continue
            text = open(os.path.join(base, f), encoding="utf-8").read()
            if re.search(r"^\s*(MASKED|NEG)\s*=|def (mask_for|causal_mask)\b|-1e9\)", text, re.M):
                offenders.append(os.path.relpath(os.path.join(base, f), ROOT))
    assert not offenders, offenders


class Documents(nn.Cell):
    """The packed-row rules in the graph: (segment, start, positions, mask, targets)."""

    def __init__(self, window):
        super().__init__()
        self.window = window

    def construct(self, ends, targets):
        segment, start, pos = document_layout(ends, targets.shape[1])
        return (segment, start, pos, document_mask(segment, self.window, ms.float32),
                document_targets(targets, segment, -100))


@pytest.mark.usefixtures("graph_mode")   # the rules run inside the model's graph: check them there
@pytest.mark.parametrize("window", [None, 3])
def test_document_rules_hand_checked_and_against_the_float64_reference(window):
    """Packed rows (MindFormers' actual_seq_len, padded with T): row 0 holds documents of 3, 4, 2
    tokens and a padding tail of 1; row 1 one document filling the row. Positions, segments and
    targets hand-checked; the mask element by element from the rule (same segment, causal, window)."""
    ends = np.array([[3, 7, 9, 10], [10, 10, 10, 10]], np.int32)
    targets = np.arange(20, dtype=np.int32).reshape(2, 10) + 100
    seg, start, pos, mask, tgt = (x.asnumpy() for x in Documents(window)(ms.Tensor(ends), ms.Tensor(targets)))
    np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 2, 3, 0, 1, 0], list(range(10))])
    np.testing.assert_array_equal(start, [[0, 0, 0, 3, 3, 3, 3, 7, 7, 9], [0] * 10])
    np.testing.assert_array_equal(seg[0], [0, 0, 0, 1, 1, 1, 1, 2, 2, 3])
    # the last token of each document (slots 2, 6, 8) predicts nothing; slot 9 (the row's end) keeps its target
    want = targets.copy()
    want[0, [2, 6, 8]] = -100
    np.testing.assert_array_equal(tgt, want)
    doc = [[0, 0, 0, 1, 1, 1, 1, 2, 2, 3], [0] * 10]
    for b in range(2):
        for q in range(10):
            for k in range(10):
                seen = doc[b][k] == doc[b][q] and k <= q and (window is None or k > q - window)
                assert mask[b, 0, q, k] == (0.0 if seen else MASKED), (b, q, k)
