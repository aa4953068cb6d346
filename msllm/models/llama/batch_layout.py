"""The batch layout rules of the model: which cache slot holds which token, each row's positions,
and which keys a query sees. The one owner of these rules: the model, generation, serving and
evaluation all build their inputs here.

Layout of a batch of B rows over a cache of S slots:

* **left padding** (:func:`left_pad`): row b's prompt of n_b tokens sits in slots
  ``pad_b .. P-1`` of a P-slot prompt block, ``pad_b = P - n_b``; new token k goes to slot P + k.
* **positions** (:func:`positions_for`): the token in slot s of row b has position
  ``s - pad_b``, so the rotary embedding sees each row as if it were alone (what HF's
  ``generate`` does with a left-padded ``attention_mask``: ``position_ids = cumsum(mask) - 1``).
* **key positions** (:func:`key_positions`): the (B, S) int32 position of the token each slot
  holds, :data:`HIDDEN` (-1) where the row has no token it may see (padding, an empty row, a
  slot not written yet). This is what the model takes instead of a mask.
* **visibility** (:func:`additive_mask`, built in the model's graph): the query of position q in
  row b sees the key in slot s iff ``0 <= kpos[b, s] <= q`` and, with a sliding window W,
  ``kpos[b, s] > q - W`` (transformers' ``sliding_window_overlay``: Mistral v0.1). A window may
  differ per layer (Qwen2's ``max_window_layers``, Gemma 2's alternate layers): the rule takes
  the window as an argument and the model builds one mask per distinct window.

Packed rows (several whole documents in one row, :mod:`msllm.data.packing`) carry
``actual_seq_len`` (B, N) int32, MindFormers' column: the cumulative end of each document over the
row's T slots, padded with T (MindFormers' ``HFDataset._iter_packed_data``,
``mindformers/dataset/dataloader/hf_dataloader.py``). From it (:func:`document_layout`):

* **segment** of slot t: the number of ends ``<= t`` (slots after the last end, the padding,
  form one more segment);
* **start** of slot t: the largest end ``<= t`` (0 in the first document), and its **position**
  ``t - start``: positions restart at every document (MindFormers' ``position_ids``, MindSpeed's
  ``--reset-position-ids``), so each document is rotated as if it were alone;
* **visibility** (:func:`document_mask`): the query in slot q sees the key in slot k iff they are
  in the same segment and ``k <= q`` (and ``k > q - W`` with a window): block-diagonal causal
  attention (MindSpeed's ``--reset-attention-mask``; FlashAttentionScore's ``actual_seq_qlen``);
* **targets** (:func:`document_targets`): slot t's target is the token in slot t + 1; it is
  ignored when slot t + 1 starts another document (t + 1 < T), so no label crosses a document.

The model's additive mask uses :data:`MASKED` (-1e9, not -inf: a fully hidden row, such as an
empty serving row, gives finite scores and zero attention instead of NaN; msllm's decode kernel
skips keys at or below -1e8). Only masks of the sequence in use are built, (B, 1, T, S): never
tables of the model's ``max_position_embeddings``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import ops

MASKED = -1e9   # the additive mask value of a hidden key
HIDDEN = -1     # key position of a slot that no query of its row sees


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (B, length) int32 left-padded with ``pad_id``, pads (B,) int64 = slots of padding).

    Raises ValueError if a prompt is longer than ``length``."""
    ids = np.full((len(prompts), length), pad_id, np.int32)
    pads = np.zeros(len(prompts), np.int64)
    for b, p in enumerate(prompts):
        if len(p) > length:
            raise ValueError(f"left_pad: a prompt of {len(p)} tokens does not fit {length} slots")
        pads[b] = length - len(p)
        ids[b, pads[b]:] = p
    return ids, pads


def positions_for(pads: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """(B, T) int32 positions of ``slots`` (T,) (or (B, T): each row its own slots) in rows padded
    by ``pads`` (B,); 0 on padding (a pad slot's query is never read)."""
    slots = np.asarray(slots)
    if slots.ndim == 1:
        slots = slots[None, :]
    return np.maximum(slots - np.asarray(pads)[:, None], 0).astype(np.int32)


def key_positions(pads: np.ndarray, buffer: int) -> np.ndarray:
    """(B, S) int32 position of each slot's token for left-padded rows (``pads`` (B,) int; a
    negative pad marks an empty row: every slot hidden); :data:`HIDDEN` on padding. Slots after a
    row's query (not written yet, or left by an earlier request of a serving row) need no
    hiding: their positions exceed the query's, so causality hides them."""
    pads = np.asarray(pads, np.int64)
    s = np.arange(buffer)[None, :]
    hide = (s < pads[:, None]) | (pads[:, None] < 0)
    return np.where(hide, HIDDEN, s - pads[:, None]).astype(np.int32)


def additive_mask(kpos, qpos, window: Optional[int], dtype):
    """The visibility rule (module doc) as an additive mask, in the graph: ``kpos`` (B, S) and
    ``qpos`` (B, T) int32 Tensors (B may be 1 on either side: broadcast) -> (B, 1, T, S) of
    ``dtype``, 0 where seen and :data:`MASKED` elsewhere (MindSpore ops, usable inside a Cell's
    construct). ``window`` is a compile-time constant (None: causal only)."""
    k = ops.expand_dims(ops.expand_dims(kpos, 1), 1)          # (B, 1, 1, S)
    q = ops.expand_dims(ops.expand_dims(qpos, 1), 3)          # (B, 1, T, 1)
    seen = ops.logical_and(k >= 0, k <= q)                    # (B, 1, T, S)
    if window is not None:
        seen = ops.logical_and(seen, k > q - window)
    # 0 where seen, MASKED elsewhere: (seen - 1) * -MASKED, in float32 then cast
    return ops.cast((ops.cast(seen, ms.float32) - 1.0) * (-MASKED), dtype)


def host_additive_mask(kpos: np.ndarray, qpos: np.ndarray, window: Optional[int]) -> np.ndarray:
    """:func:`additive_mask`'s rule on the host, for a caller that launches the kernels itself
    (msllm/generation/direct_step.py): ``kpos`` (B, S) and ``qpos`` (B, T) int32 arrays (B may be 1 on
    either side) -> (B, 1, T, S) float32, 0 where seen and :data:`MASKED` elsewhere, the same values
    as the graph's (tests/models/test_batch_layout.py checks both against one reference)."""
    k = np.asarray(kpos)[:, None, None, :]                    # (B, 1, 1, S)
    q = np.asarray(qpos)[:, None, :, None]                    # (B, 1, T, 1)
    seen = (k >= 0) & (k <= q)
    if window is not None:
        seen &= k > q - np.int32(window)
    return np.where(seen, np.float32(0.0), np.float32(MASKED))


def causal_positions(t: int):
    """In-graph (1, T) int32 positions 0..T-1 (a causal row alone: query and key positions)."""
    return ops.expand_dims(ops.arange(0, t, dtype=ms.int32), 0)


def document_layout(actual_seq_len, t: int):
    """In-graph per-document layout of packed rows (module doc): ``actual_seq_len`` (B, N) int32
    document ends (padded with T) -> (segment (B, T) float32, start (B, T) float32, positions
    (B, T) int32). Float32 because MindSpore's CPU reductions take it; exact below 2^24 slots.
    No gradient flows through it."""
    ends = ops.expand_dims(ops.cast(ops.stop_gradient(actual_seq_len), ms.float32), 2)   # (B, N, 1)
    slots = ops.reshape(ops.arange(0, t, dtype=ms.float32), (1, 1, t))                   # (1, 1, T)
    done = ops.cast(ends <= slots, ms.float32)                                            # (B, N, T)
    segment = ops.ReduceSum()(done, 1)                                                    # (B, T)
    start = ops.ReduceMax()(done * ends, 1)                                               # (B, T)
    positions = ops.cast(slots[:, 0] - start, ms.int32)                                   # (B, T)
    return segment, start, positions


def document_mask(segment, window: Optional[int], dtype):
    """The block-diagonal causal rule (module doc) as an additive mask: ``segment`` (B, T) float32
    from :func:`document_layout` -> (B, 1, T, T) of ``dtype``, 0 where seen, :data:`MASKED`
    elsewhere. ``window``: a compile-time constant (None: causal within the document)."""
    t = segment.shape[1]
    k = ops.reshape(ops.arange(0, t, dtype=ms.int32), (1, 1, 1, t))
    q = ops.reshape(ops.arange(0, t, dtype=ms.int32), (1, 1, t, 1))
    same = ops.expand_dims(ops.expand_dims(segment, 1), 1) == ops.expand_dims(ops.expand_dims(segment, 1), 3)
    seen = ops.logical_and(same, k <= q)                                                  # (B, 1, T, T)
    if window is not None:
        seen = ops.logical_and(seen, k > q - window)
    return ops.cast((ops.cast(seen, ms.float32) - 1.0) * (-MASKED), dtype)


def document_targets(targets, segment, ignore: int):
    """``targets`` (B, T) int32 with the target of every document's last slot set to ``ignore``
    (slot t + 1 < T in another segment: its token belongs to the next document)."""
    crosses = segment[:, 1:] != segment[:, :-1]                                           # (B, T-1)
    crosses = ops.concat((crosses, ops.zeros_like(crosses[:, :1])), 1)                    # (B, T)
    return ops.select(crosses, ops.full_like(targets, ignore), targets)


__all__ = ["MASKED", "HIDDEN", "left_pad", "positions_for", "key_positions", "additive_mask", "host_additive_mask", "causal_positions",
           "document_layout", "document_mask", "document_targets"]
