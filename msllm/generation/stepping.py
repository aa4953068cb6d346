"""The per-row token decision, the one token loop body of msllm: :meth:`Generator.generate
<msllm.generation.decode.Generator.generate>` (predict, chat, the Python API) and the serving
engine's continuous batch (:mod:`msllm.serving.batch`) both decide each row's next token here.

A row's step, given its logits (V,):

1. **choose** (:meth:`RowStep.choose`): the logits processors, then argmax (greedy) or a draw
   (sampling) (:func:`msllm.generation.processors.choose`: temperature, top-k, top-p, repetition
   penalty over the prompt and the tokens so far, as transformers' ``generate``);
2. **accept** (:meth:`RowStep.accept`): the token joins the row's output; the row finishes at an
   EOS id (kept in the output, as HF does) with reason ``eos``, or after ``max_new`` tokens
   (``max_new_tokens`` or the context window's end) with ``length``;
3. **stop strings** (:class:`StopText`, when the row streams text): the text is cut before the
   first stop string and the row finishes with ``stop``; while streaming, text that could still
   become the start of a stop string, or an unfinished UTF-8 character, is held back.

Each step costs time in the new token only, not in the output so far: the text grows by pieces
(:class:`TextStream`) and stop strings are searched in the new tail.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from msllm.generation import processors


def decode_new(tokenizer, tokens: Sequence[int], eos_ids: Sequence[int] = ()) -> str:
    """Text of generated ``tokens`` without EOS ids and ids outside the tokenizer's vocabulary."""
    eos = set(eos_ids)
    return tokenizer.decode([t for t in tokens if t not in eos and 0 <= t < tokenizer.vocab_size])


class TextStream:
    """Turns a growing list of token ids into text pieces to print: ``push(token) -> new text``.

    Incremental detokenisation as Hugging Face text-generation-inference does it
    (``server/text_generation_server/models/model.py`` ``decode_token``): decode a short window
    of the tokens already shown and the same window plus the new tokens, and print the difference
    once it does not end in an unfinished UTF-8 sequence (U+FFFD: byte-level BPE splits characters
    across tokens). The window starts at a token boundary already printed, so SentencePiece's
    leading-space rule and multi-byte characters come out right, and a later token never changes
    text already printed: the concatenated pieces are :attr:`text` up to any held-back tail.
    """

    def __init__(self, tokenizer, eos_ids: Sequence[int] = ()):
        self.tokenizer, self.eos = tokenizer, set(eos_ids)
        self.ids: list[int] = []
        self.shown = ""
        self._prefix = 0   # the window: ids[_prefix:_read] are printed context
        self._read = 0

    @property
    def text(self) -> str:
        return decode_new(self.tokenizer, self.ids, self.eos)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = decode_new(self.tokenizer, self.ids[self._prefix:self._read], self.eos)
        after = decode_new(self.tokenizer, self.ids[self._prefix:], self.eos)
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        piece = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.shown += piece
        return piece


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string (0 if none).
    Cost: the stop strings' lengths squared, whatever ``text``'s length."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopText:
    """A row's streamed text with stop strings: ``push(token) -> (new text to show, stopped)``.

    The text shown is always a prefix of the final answer: cut before the first stop string,
    never showing a tail that could start one or an unfinished character. :attr:`text` is the
    answer so far (after ``stopped`` or :meth:`finish`: the final one).

    Args:
        tokenizer: has ``decode(ids) -> str`` (:mod:`msllm.data.tokenizer`).
        eos_ids: ids not turned into text.
        stops: stop strings (none: the text is only streamed).
    """

    def __init__(self, tokenizer, eos_ids: Sequence[int] = (), stops: Sequence[str] = ()):
        self.stream = TextStream(tokenizer, eos_ids)
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.full = ""        # every final piece so far (TextStream's pieces, concatenated)
        self.n_shown = 0      # full[:n_shown] has been given out
        self.stopped = False

    @property
    def text(self) -> str:
        return self.full
    def push(self, token: int) -> tuple[str, bool]:
        """Add ``token``; returns (text newly safe to show, whether a stop string appeared)."""
        if self.stopped:
            return "", True
        before = len(self.full)
        self.full += self.stream.push(token)
        if self.stops:
            # a stop string that ends in the new piece starts at most longest - 1 chars before it
            lo = max(0, before - self.longest + 1)
            hits = [i for i in (self.full.find(s, lo) for s in self.stops) if i >= 0]
            if hits:
                self.full, self.stopped = self.full[:min(hits)], True
                return self._show(len(self.full)), True
        return self._show(len(self.full) - held_back(self.full, self.stops)), False

    def finish(self) -> str:
        """At the row's end (EOS, length): the rest of the text, held-back tail included (and
        a last unfinished character as the tokenizer decodes it). Returns the new part."""
        if self.stopped:
            return ""
        rest = self.stream.text       # one whole decode at the end, not per token
        if rest.startswith(self.full):
            self.full = rest
        hits = [i for i in (self.full.find(s) for s in self.stops) if i >= 0]
        if hits:                      # a stop string completed by the final decode
            self.full, self.stopped = self.full[:min(hits)], True
        return self._show(len(self.full))

    def _show(self, end: int) -> str:
        """Give out full[n_shown:end] (what was shown is never taken back)."""
        if end <= self.n_shown:
            return ""
        piece, self.n_shown = self.full[self.n_shown:end], end
        return piece


class RowStep:
    """One row's decision state: its settings, random generator, the tokens it has seen (for
    the repetition penalty), its output and finish reason.

    Args:
        settings: :class:`~msllm.config_generation.DecodeSettings` (sampling, EOS ids).
        max_new: tokens at most (``length`` after them).
        rng: numpy ``Generator`` for sampling (None: greedy).
        prompt: the row's prompt ids (the repetition penalty counts them).
    """

    def __init__(self, settings, max_new: int, rng: Optional[np.random.Generator] = None,
                 prompt: Sequence[int] = ()):
        self.settings, self.max_new, self.rng = settings, int(max_new), rng
        self.eos = frozenset(int(e) for e in settings.eos_token_id)
        self.seen = np.asarray(prompt, np.int64) if settings.repetition_penalty != 1.0 else None
        self.tokens: list[int] = []
        self.reason: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.reason is not None

    def choose(self, logits: np.ndarray) -> int:
        """This row's next token from its logits (V,) float32."""
        return int(choose_rows(logits[None], [self], self.settings, self.rng)[0])

    def accept(self, token: int) -> Optional[str]:
        """Record ``token``; returns the finish reason it causes (``eos`` / ``length``) or None."""
        token = int(token)
        self.tokens.append(token)
        if self.seen is not None:
            self.seen = np.append(self.seen, token)
        if token in self.eos:
            self.reason = "eos"
        elif len(self.tokens) >= self.max_new:
            self.reason = "length"
        return self.reason

    def stop(self, reason: str = "stop") -> None:
        """Finish the row from outside (a stop string, the client gone); a stop string in the
        row's last allowed token still counts as ``stop`` (OpenAI's and HF's finish reason)."""
        if self.reason in (None, "length"):
            self.reason = reason


def choose_rows(logits: np.ndarray, rows: Sequence[RowStep], settings, rng) -> np.ndarray:
    """Tokens (B,) int64 of ``rows`` from their logits (B, V) under one ``settings`` and ``rng``
    (a batch decoded together draws from one generator, row by row in order, as
    :func:`~msllm.generation.processors.choose`)."""
    seen = [r.seen for r in rows] if settings.repetition_penalty != 1.0 else None
    return processors.choose(logits, settings, rng, seen)


__all__ = ["decode_new", "TextStream", "held_back", "StopText", "RowStep", "choose_rows"]
