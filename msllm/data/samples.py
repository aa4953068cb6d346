"""Building the rows of a training MindRecord (pure functions, used by
:mod:`msllm.data.preprocess`'s workers and by the tests): one ``qa`` sample from a conversation,
right padding to ``seq_length + 1``, packing ``wiki`` documents into blocks, and the write order.
The formats are described in :mod:`msllm.data.preprocess`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from msllm.data.conversation import HUMAN, conversation_skip_reason
from msllm.data.templates import IGNORE_INDEX, Template, encode_segments, encode_segments_batch, get_template
from msllm.errors import MsllmError

LIBRARY_TEMPLATE = "alpaca"
"""Template of :func:`build_qa_sample` / :func:`msllm.data.preprocess.preprocess_to_mindrecord`
when none is given (their callers predate templates); the command line defaults to
:data:`msllm.data.templates.DEFAULT_TEMPLATE` (``vicuna_v1.1``)."""

SKIP_NO_RESPONSE = "no response tokens within seq_length"


@dataclasses.dataclass(frozen=True)
class QAResult:
    """Outcome of :func:`build_qa_sample` for one conversation.

    Attributes:
        input_ids: int32 ``[n]`` with ``n <= seq_length + 1`` (unpadded), or ``None`` if skipped.
        labels: int32 ``[n]``, ``IGNORE_INDEX`` on prompt tokens, or ``None`` if skipped.
        truncated: the full conversation was longer than ``seq_length + 1`` tokens.
        skip_reason: why no sample was made (``None`` when a sample was made).
    """

    input_ids: np.ndarray | None
    labels: np.ndarray | None
    truncated: bool = False
    skip_reason: str | None = None


def build_qa_sample(tokenizer, turns: Sequence[tuple[str, str]], seq_length: int,
                    template: Template | str = LIBRARY_TEMPLATE) -> QAResult:
    """Build one (unpadded) ``qa`` sample from a conversation's ``(role, value)`` turns.

    One leading non-human turn is dropped (MindFormers' ``preprocess``: "Skip the first one if
    it is not from human"). Conversations that are then empty or do not alternate human/gpt
    ending with gpt get ``skip_reason`` from
    :func:`msllm.data.conversation.conversation_skip_reason`; the rest are rendered by
    ``template`` (a :class:`~msllm.data.templates.Template` or its name, or a
    :class:`~msllm.data.chat_template.ChatTemplate`) with ``tokenizer`` (either kind) and tokenised by
    :func:`~msllm.data.templates.encode_segments`, then cut to ``seq_length + 1`` tokens; a
    sample with no label != ``IGNORE_INDEX`` left gets :data:`SKIP_NO_RESPONSE`.
    """
    if isinstance(template, str):
        template = get_template(template)
    segments = _segments_or_skip(turns, template)
    if isinstance(segments, QAResult):
        return segments
    ids, labels = encode_segments(tokenizer, segments)
    return _cut(ids, labels, seq_length)


def build_qa_samples(tokenizer, conversations: Sequence[Sequence[tuple[str, str]]], seq_length: int,
                     template: Template | str = LIBRARY_TEMPLATE) -> list[QAResult | MsllmError]:
    """:func:`build_qa_sample` of several conversations, their texts encoded in one batch call
    (:func:`~msllm.data.templates.encode_segments_batch`); equal to calling it on each. A
    conversation the template refuses gets its :class:`MsllmError` in its place (the caller names
    the file and conversation), the others are built.
    """
    if isinstance(template, str):
        template = get_template(template)
    out: list = []
    pending: list[tuple[int, object]] = []   # (index in out, segments)
    for turns in conversations:
        try:
            segments = _segments_or_skip(turns, template)
        except MsllmError as exc:
            out.append(exc)
            continue
        if not isinstance(segments, QAResult):
            pending.append((len(out), segments))
        out.append(segments)   # segments are replaced by the sample below
    encoded = encode_segments_batch(tokenizer, [seg for _, seg in pending])
    for (k, _), (ids, labels) in zip(pending, encoded):
        out[k] = _cut(ids, labels, seq_length)
    return out


def _segments_or_skip(turns: Sequence[tuple[str, str]], template):
    """The template's segments of a conversation, or its skip :class:`QAResult`: one leading
    non-human turn dropped, then :func:`~msllm.data.conversation.conversation_skip_reason`.
    Raises MsllmError when the template refuses the conversation."""
    turns = list(turns)
    if turns and turns[0][0] != HUMAN:
        turns = turns[1:]
    reason = conversation_skip_reason(turns)
    if reason is not None:
        return QAResult(None, None, skip_reason=reason)
    return template.segments(turns)


def _cut(ids: list[int], labels: list[int], seq_length: int) -> QAResult:
    """A sample of at most ``seq_length + 1`` tokens, or the no-response skip."""
    limit = seq_length + 1
    truncated = len(ids) > limit
    if truncated:
        ids, labels = ids[:limit], labels[:limit]
    if all(v == IGNORE_INDEX for v in labels):
        return QAResult(None, None, truncated=truncated, skip_reason=SKIP_NO_RESPONSE)
    return QAResult(np.asarray(ids, np.int32), np.asarray(labels, np.int32), truncated=truncated)


def pad_sample(
    input_ids: np.ndarray, labels: np.ndarray, seq_length: int, pad_token_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to ``seq_length + 1``: ``input_ids`` with ``pad_token_id``, ``labels`` with
    :data:`IGNORE_INDEX`. Returns two int32 arrays of shape ``[seq_length + 1]``."""
    length = seq_length + 1
    n = int(input_ids.shape[0])
    if n > length:
        raise ValueError(f"sample of {n} tokens is longer than seq_length + 1 = {length}")
    ids = np.full(length, pad_token_id, np.int32)
    lab = np.full(length, IGNORE_INDEX, np.int32)
    ids[:n] = input_ids
    lab[:n] = labels
    return ids, lab


class BlockPacker:
    """Packs documents into fixed-length blocks for ``wiki`` pretraining data.

    Each document's ids become ``[bos] + ids + [eos]`` (no BOS when ``bos_id`` is None: a
    tokenizer that adds none, e.g. Qwen's) in one running stream; every time the
    stream holds ``block_length`` tokens a block (int32 ``[block_length]``) is emitted.
    After the last document, :attr:`pending` tokens remain: the dropped tail.
    """

    def __init__(self, block_length: int, bos_id: int | None, eos_id: int):
        self.block_length = block_length
        self.bos_id = bos_id
        self.eos_id = eos_id
        self._buf: list[int] = []
        self.stream_tokens = 0

    def add(self, ids: Iterable[int]) -> list[np.ndarray]:
        """Append one document; return the blocks completed by it (possibly none)."""
        before = len(self._buf)
        if self.bos_id is not None:
            self._buf.append(self.bos_id)
        self._buf.extend(int(i) for i in ids)
        self._buf.append(self.eos_id)
        self.stream_tokens += len(self._buf) - before
        b = self.block_length
        full = len(self._buf) // b
        blocks = [np.asarray(self._buf[k * b:(k + 1) * b], np.int32) for k in range(full)]
        del self._buf[: full * b]
        return blocks

    @property
    def pending(self) -> int:
        """Tokens not yet in a block (dropped if no more documents come)."""
        return len(self._buf)


def pack_documents(
    docs: Iterable[Sequence[int]], seq_length: int, bos_id: int, eos_id: int
) -> tuple[np.ndarray, int]:
    """Pack tokenized documents into int32 blocks ``[num_blocks, seq_length + 1]``.

    Returns ``(blocks, dropped_tail_tokens)``; see :class:`BlockPacker`.
    """
    packer = BlockPacker(seq_length + 1, bos_id, eos_id)
    blocks: list[np.ndarray] = []
    for doc in docs:
        blocks.extend(packer.add(doc))
    arr = np.stack(blocks) if blocks else np.zeros((0, seq_length + 1), np.int32)
    return arr, packer.pending


def sample_order(num_samples: int, repeat: int, shuffle: bool, seed: int) -> np.ndarray:
    """Indices (int64 ``[num_samples * repeat]``) of the samples to write, in write order.

    The list ``0..num_samples-1`` is repeated ``repeat`` times; if ``shuffle``, the repeated
    list is permuted by ``numpy.random.default_rng(seed).permutation``.
    """
    order = np.tile(np.arange(num_samples, dtype=np.int64), repeat)
    if shuffle:
        order = np.random.default_rng(seed).permutation(order)
    return order
