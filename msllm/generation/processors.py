"""Logits processors and the sampler, on the host in numpy over (B, V) float32 scores.

Each function reproduces one Hugging Face processor of
``transformers/generation/logits_process.py`` (transformers 5.x), and :func:`process` applies them
in the order ``GenerationMixin._get_logits_processor`` builds the list: repetition penalty first
(for greedy, sampling and beam search), then, only when sampling, temperature, top-k, top-p.
Filtered entries become ``-inf`` (HF's ``filter_value``). The test
``tests/generation/test_generation_processors.py`` checks each against the HF class on the same
random scores.

The scores of one decode step are (B, V) with V = 32000 for LLaMA: a few hundred microseconds of
numpy per step, small next to the model, and it keeps the compiled graph free of
sampling-specific shapes (one graph serves greedy, sampling and beam search).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from msllm.config_generation import DecodeSettings

NEG_INF = -np.inf


def repetition_penalty(scores: np.ndarray, seen: Sequence[np.ndarray], penalty: float) -> np.ndarray:
    """HF ``RepetitionPenaltyLogitsProcessor`` (CTRL, Keskar et al. 2019): for every token id a row
    has seen (its prompt, without padding, and what it generated), a score s becomes ``s * penalty``
    if s < 0 else ``s / penalty``; applied once per id however often it occurred.

    scores (B, V) float32; seen: B int arrays of token ids (HF ignores left padding via
    ``prompt_ignore_length``: pass only real tokens). Returns a new (B, V) array.
    """
    out = scores.copy()
    for b, ids in enumerate(seen):
        ids = np.unique(np.asarray(ids, np.int64))
        ids = ids[(ids >= 0) & (ids < scores.shape[1])]
        s = out[b, ids]
        out[b, ids] = np.where(s < 0, s * penalty, s / penalty)
    return out


def temperature(scores: np.ndarray, t: float) -> np.ndarray:
    """HF ``TemperatureLogitsWarper``: ``scores / t`` (t > 0)."""
    return scores / np.float32(t)


def top_k(scores: np.ndarray, k: int, min_tokens_to_keep: int = 1) -> np.ndarray:
    """HF ``TopKLogitsWarper``: keep scores >= the k-th largest of each row (ties at the k-th value
    are all kept, as HF's ``scores < topk[..., -1]`` keeps them), the rest -inf."""
    k = min(max(k, min_tokens_to_keep), scores.shape[-1])
    kth = np.partition(scores, -k, axis=-1)[:, -k][:, None]               # (B, 1)
    return np.where(scores < kth, NEG_INF, scores).astype(scores.dtype)


def top_p(scores: np.ndarray, p: float, min_tokens_to_keep: int = 1) -> np.ndarray:
    """HF ``TopPLogitsWarper`` (nucleus sampling, Holtzman et al. 2019): sort ascending, softmax,
    cumulative sum; drop the tokens whose cumulative probability is <= 1 - p (so the kept set is
    the smallest top set with mass >= p), always keeping the ``min_tokens_to_keep`` largest."""
    order = np.argsort(scores, axis=-1, kind="stable")                     # ascending, (B, V)
    sorted_scores = np.take_along_axis(scores, order, axis=-1)
    cum = np.cumsum(softmax(sorted_scores), axis=-1)
    remove_sorted = cum <= (1.0 - p)
    remove_sorted[:, -min_tokens_to_keep:] = False
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return np.where(remove, NEG_INF, scores).astype(scores.dtype)


def softmax(scores: np.ndarray) -> np.ndarray:
    """Row softmax in float32; -inf entries get probability 0."""
    z = scores - np.max(scores, axis=-1, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=-1, keepdims=True)


def log_softmax(scores: np.ndarray) -> np.ndarray:
    """Row log-softmax in float32 (for beam search, as HF's ``nn.functional.log_softmax``)."""
    z = scores - np.max(scores, axis=-1, keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def process(scores: np.ndarray, s: DecodeSettings, seen: Optional[Sequence[np.ndarray]] = None) -> np.ndarray:
    """Apply the processors ``s`` asks for, in HF's order (module doc); scores (B, V) float32.

    ``seen``: per row, the token ids the repetition penalty looks at (needed only when
    ``s.repetition_penalty != 1``).
    """
    if s.repetition_penalty != 1.0:
        scores = repetition_penalty(scores, seen, s.repetition_penalty)
    if s.do_sample:
        if s.temperature != 1.0:
            scores = temperature(scores, s.temperature)
        if s.top_k:
            scores = top_k(scores, s.top_k)
        if s.top_p < 1.0:
            scores = top_p(scores, s.top_p)
    return scores


def sample(scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row from ``softmax(scores)`` (B, V) -> (B,) int64, by inverting the CDF with
    one uniform draw per row from ``rng`` (so a seed fixes the draws)."""
    probs = softmax(scores.astype(np.float64))
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(scores.shape[0]) * cdf[:, -1]
    picks = np.array([np.searchsorted(cdf[b], u[b], side="right") for b in range(scores.shape[0])])
    return np.minimum(picks, scores.shape[1] - 1)


def choose(scores: np.ndarray, s: DecodeSettings, rng: Optional[np.random.Generator],
           seen: Optional[Sequence[np.ndarray]] = None) -> np.ndarray:
    """The next token of each row: processed scores, then argmax (greedy) or a draw (sampling).
    scores (B, V) float32 -> (B,) int64."""
    scores = process(scores, s, seen)
    if s.do_sample:
        return sample(scores, rng)
    return np.argmax(scores, axis=-1)
