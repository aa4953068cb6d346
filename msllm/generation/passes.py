"""The forward passes of one generation call and its result, shared by sampling / greedy decoding
(:mod:`msllm.generation.decode`) and beam search (:mod:`msllm.generation.beam`), so that neither
imports the other for them. The batch layout (left padding, slots, cache buffer) is described in
:mod:`msllm.generation.decode`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from msllm.config_generation import DecodeSettings

if TYPE_CHECKING:
    from msllm.generation.decode import Generator

SLOT_MULTIPLE = 32      # prompt and buffer lengths are rounded up to this: fewer distinct graphs


def round_up(n: int, multiple: int = SLOT_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def pow2_at_least(n: int, smallest: int = 1) -> int:
    """The smallest power-of-two multiple of ``smallest`` that is >= n: the length buckets of
    caches and inputs, so a few graph shapes serve every request (compiled once each)."""
    r = smallest
    while r < n:
        r *= 2
    return r



@dataclass
class GenerationResult:
    """Output of :meth:`Generator.generate` for B prompts.

    tokens: per row, the new token ids (list of int; a row that stopped at EOS ends with it).
    finish_reasons: per row ``"eos"`` (stopped at an EOS id), ``"length"`` (max new tokens) or
        ``"stop"`` (the stream callback asked to stop).
    scores: per row the beam score (beam search only: sum of log-probabilities / length **
        length_penalty, HF's ``sequences_scores``), else None.
    prefill_s: seconds from the call to the first new token of every row (time to first token,
        including any compilation of a new shape); decode_s: seconds for the remaining tokens.
    steps: decode steps run after the prefill.
    compiled: the (kind, B, T, S) shapes the generator has run so far (:attr:`Generator.shapes`).
    logits: with ``keep_logits``, the raw (B, V) float32 logits each new token was chosen from
        (HF's ``output_logits``), else None.
    """

    tokens: list
    finish_reasons: list
    scores: Optional[list] = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    compiled: list = field(default_factory=list)
    logits: Optional[list] = None

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


class Passes:
    """The forward passes of one generation call (:meth:`Generator.generate`,
    :func:`msllm.generation.beam.beam_search`): the first, made on construction, over the B
    ``prompts`` (lists of int) laid out by :meth:`Generator.layout` (P = ``length``), then one per
    new token (:meth:`next`). With the cache (``use_past``): a prefill of the prompts
    (left-padded to P slots) into a cache of S = ``buffer`` slots, then one decode step per token;
    without it: each time the whole sequences, right-aligned in W = P + max_new slots (rounded up
    to :data:`SLOT_MULTIPLE`). ``logits`` (B, V) float32: the latest pass's last-token logits.
    """

    def __init__(self, gen: "Generator", prompts: Sequence[Sequence[int]], s: DecodeSettings, length: int,
                 max_new: int, buffer: int):
        self.gen, self.use_past, self.pad_id = gen, s.use_past, s.pad_token_id
        self.length, self.buffer = length, buffer
        if self.use_past:
            self.logits, self.caches, self.pads = gen.prefill(prompts, length, buffer, self.pad_id)
        else:
            self.width = round_up(length + max_new)
            self.logits = gen.full_forward(prompts, self.width, self.pad_id)

    def next(self, k: int, tokens: np.ndarray, sequences: Callable[[], list], beam_idx=None) -> np.ndarray:
        """Logits (B, V) after new token ``k`` (0-based): ``tokens`` (B,) int64, the tokens chosen
        at step k (the cache path feeds them at slot P + k, after taking the cache rows
        ``beam_idx`` (B,) when given); ``sequences()`` the whole sequences (prompt + new tokens,
        lists of int), called only without the cache."""
        if self.use_past:
            self.logits, self.caches = self.gen.decode_step(tokens, self.length + k, self.pads, self.buffer,
                                                            self.caches, beam_idx)
        else:
            self.logits = self.gen.full_forward(sequences(), self.width, self.pad_id)
        return self.logits

    def release(self) -> None:
        """Give the cache back to the generator (:meth:`Generator.release_cache`); no pass after this."""
        if self.use_past:
            self.gen.release_cache(self.caches)
            self.caches = None
