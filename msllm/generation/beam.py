"""Beam search (``num_beams > 1``, no sampling) with Hugging Face's exact semantics.

Follows ``GenerationMixin._beam_search`` of transformers 5.x (``transformers/generation/utils.py``:
``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
``_update_finished_beams``, ``_check_early_stop_heuristic``,
``_beam_search_has_unfinished_sequences``), step by step, in float32 numpy on the host:

1. per step, ``log_softmax`` of the logits (then the logits processors, i.e. the repetition
   penalty), plus each running beam's score; per prompt the top ``K = max(2, 1 + n_eos) * num_beams``
   of the ``num_beams * V`` continuations (K > num_beams so that enough beams survive when the best
   ones end in EOS); the first beam starts at 0 and the others at -1e9, so step 1 expands beam 0 only;
2. a continuation that ends in an EOS id or reaches the maximum length "hits a stopping criterion":
   the next running beams are the best ``num_beams`` continuations that did not;
3. among the first ``num_beams`` of the K (only those), the ones that stopped become finished
   hypotheses with score ``sum of log-probs / generated_length ** length_penalty`` (the length
   counts the EOS); the best ``num_beams`` finished hypotheses so far are kept;
4. stop when no running beam can beat the worst kept hypothesis (HF's heuristic: the best running
   score over the current length, or the maximum length when ``early_stopping="never"`` and
   ``length_penalty > 0``), when every hypothesis slot is full and ``early_stopping=True``, or at the
   maximum length. The result per prompt is the best hypothesis; its score is HF's
   ``sequences_scores``.

The key/value cache of the running beams is reordered in place each step by a compiled graph of
its own (``Generator.reorder_caches``: a gather of the cache rows by source beam), then the step
is greedy decoding's compiled step, so beam search runs the same static shapes as greedy decoding
with ``B * num_beams`` rows.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from msllm.generation import processors
from msllm.config_generation import DecodeSettings
from msllm.generation.passes import GenerationResult, Passes

BIG = np.float32(-1.0e9)


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of each row of ``x`` (B, N), largest first (torch.topk)."""
    part = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(x, part, axis=-1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1)


def _take(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``x`` (B, N, ...) gathered along axis 1 by ``idx`` (B, M) -> (B, M, ...)."""
    return x[np.arange(x.shape[0])[:, None], idx]


def beam_search(gen, prompts: Sequence[Sequence[int]], s: DecodeSettings, pad_to: Optional[int] = None,
                keep_logits: bool = False, buffer: Optional[int] = None):
    """Beam search over ``prompts`` with the :class:`~msllm.generation.decode.Generator` ``gen``
    (module doc). Returns a :class:`~msllm.generation.decode.GenerationResult` whose ``tokens``
    are each prompt's best hypothesis (new tokens, ending with its EOS if it stopped there) and
    ``scores`` HF's ``sequences_scores`` (float)."""
    prompts = [list(map(int, p)) for p in prompts]
    length, max_new, buffer = gen.layout(prompts, s, pad_to, buffer)
    nb, b = s.num_beams, len(prompts)
    rows = [p for p in prompts for _ in range(nb)]                       # row b * nb + j
    eos = np.array(s.eos_token_id, np.int64)
    keep = max(2, 1 + len(eos)) * nb
    top_mask = np.arange(keep) < nb
    lp, early = s.length_penalty, s.early_stopping

    running = np.full((b, nb, max_new), s.pad_token_id, np.int64)   # new tokens of the running beams
    running_scores = np.zeros((b, nb), np.float32)
    running_scores[:, 1:] = BIG
    done = np.full((b, nb, max_new), s.pad_token_id, np.int64)      # kept finished hypotheses
    done_len = np.zeros((b, nb), np.int64)
    done_scores = np.full((b, nb), BIG, np.float32)
    done_flag = np.zeros((b, nb), bool)
    improvable = np.ones((b, 1), bool)
    kept = [] if keep_logits else None

    t0 = time.perf_counter()
    passes = Passes(gen, rows, s, length, max_new, buffer)
    try:
        logits = passes.logits
        t_first = None
        steps = 0
        for k in range(max_new):
            if kept is not None:
                kept.append(logits.copy())
            log_probs = processors.log_softmax(logits.astype(np.float32))
            if s.repetition_penalty != 1.0:
                seen = [np.concatenate([np.asarray(rows[r], np.int64), running[r // nb, r % nb, :k]])
                        for r in range(b * nb)]
                log_probs = processors.repetition_penalty(log_probs, seen, s.repetition_penalty)
            v = log_probs.shape[-1]
            acc = (log_probs.reshape(b, nb, v) + running_scores[:, :, None]).reshape(b, nb * v)
            idx = _topk(acc, keep)                                           # (B, K)
            top_scores = np.take_along_axis(acc, idx, axis=-1)
            src, tok = idx // v, idx % v
            cand = _take(running, src)                                       # (B, K, max_new)
            cand[:, :, k] = tok
            hits = np.isin(tok, eos) | (k + 1 >= max_new)                    # (B, K)

            # next running beams: the best continuations that did not stop
            run_scores = top_scores + hits.astype(np.float32) * BIG
            pick = _topk(run_scores, nb)
            running = _take(cand, pick)
            running_scores = np.take_along_axis(run_scores, pick, axis=-1)
            running_src = np.take_along_axis(src, pick, axis=-1)             # (B, nb) beam each came from

            # finished hypotheses: only the first nb of the K may enter
            just_done = hits & top_mask[None, :]
            fin = top_scores / np.float32((k + 1) ** lp)
            full = np.all(done_flag, axis=-1, keepdims=True) & (early is True)
            fin = fin + full.astype(np.float32) * BIG
            fin = fin + (~improvable).astype(np.float32) * BIG
            fin = fin + (~just_done).astype(np.float32) * BIG
            m_scores = np.concatenate([done_scores, fin], axis=1)
            best = _topk(m_scores, nb)
            done = _take(np.concatenate([done, cand], axis=1), best)
            done_len = np.take_along_axis(np.concatenate([done_len, np.full((b, keep), k + 1)], axis=1), best, axis=-1)
            done_scores = np.take_along_axis(m_scores, best, axis=-1)
            done_flag = np.take_along_axis(np.concatenate([done_flag, just_done], axis=1), best, axis=-1)

            # HF's early-stop heuristic, then its loop condition
            best_len = max_new if (early == "never" and lp > 0.0) else k + 1
            best_possible = running_scores[:, :1] / np.float32(best_len ** lp)
            worst = np.where(done_flag, np.min(done_scores, axis=1, keepdims=True), BIG)
            improvable = improvable & np.any(best_possible > worst, axis=-1, keepdims=True)
            if t_first is None:
                t_first = time.perf_counter()
            go_on = improvable.any() and not (done_flag.all() and early is True) and not hits.all()
            if not go_on:
                break
            steps += 1
            beam_idx = (np.arange(b)[:, None] * nb + running_src).reshape(-1)
            tokens = running[:, :, k].reshape(-1)
            logits = passes.next(k, tokens, lambda: [rows[r] + running[r // nb, r % nb, :k + 1].tolist()
                                                     for r in range(b * nb)], beam_idx)
    finally:
        passes.release()
    t_end = time.perf_counter()
    tokens, reasons = [], []
    for i in range(b):
        seq = done[i, 0, :done_len[i, 0]].tolist()
        tokens.append(seq)
        reasons.append("eos" if seq and seq[-1] in set(eos.tolist()) else "length")
    return GenerationResult(tokens, reasons, [float(x) for x in done_scores[:, 0]], t_first - t0,
                            t_end - t_first, steps, compiled=list(gen.shapes), logits=kept)
