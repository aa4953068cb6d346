"""How a request joins the continuous batch when its prompt is not prefilled whole in one call:
the prefix cache (``--enable_prefix_caching``) and chunked prefill (``--prefill_chunk_size``).
A mixin of :class:`msllm.serving.batch.ContinuousBatch` (its rows, caches and ``_fit_for`` /
``_write`` / ``_start_row``), used by the engine's thread only.

* A joining request whose prompt starts with a cached prefix (:mod:`msllm.serving.prefix_cache`),
  or is longer than the chunk size, is *staged*: a :class:`~msllm.serving.staged_prefill.StagedPrefill`
  computes the rest of its prompt in pieces into a one-row cache of its own, while it holds a place
  among the batch's rows (:attr:`ContinuousBatch.free` counts it). Other requests are prefilled whole
  as before (grouped by length).
* :meth:`advance` is the engine's iteration: pieces of the staged requests, oldest first, until
  at least ``chunk`` tokens were computed (no chunking: every staged request to its end), then one
  decode step of the rows. So a long prompt joining costs each decoding row about one chunk's
  prefill per token instead of the whole prompt's (vLLM's chunked prefill, its scheduler's token
  budget ``max_num_batched_tokens``: ``vllm/v1/core/sched/scheduler.py``; Agrawal et al.,
  "Sarathi-Serve", OSDI 2024).
* A staged request's last piece gives its first token; its cache's prompt slots are copied into a
  free batch row (widening the caches if needed) and it decodes like any row.
* Every prompt prefilled (whole or staged) gives its whole blocks to the prefix cache.

Greedy outputs are the same token for token with and without either (tests/serving/
test_serving_prefix_chunks.py): the keys and values of a token do not depend on how its prompt was
cut; the float rounding of the attention differs (a piece attends over the cache through the
``decode_attention`` kernel, a whole prefill through the flash kernel: SmolLM2's last logits
after a 600-token prompt in 128-token pieces within 1.3e-5, tested to 1e-4), so log-probabilities
may differ in their last digits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from msllm.serving.protocol import result

log = logging.getLogger("msllm")
# one-row caches wider than this are not kept between staged prefills (8192 slots of SmolLM2's
# keys and values are 377 MB)
SPARE_SLOTS = 2048

@dataclass(eq=False)
class Staged:
    """A request being prefilled in pieces: its plan (work, n, T, max_new), prefill and ``echo`` rows."""

    plan: tuple
    prefill: object
    prompt_info: Optional[list] = None

    @property
    def work(self):
        return self.plan[0]


class StagedJoins:
    """The mixin (module docstring); needs ``gen``, ``prefix``, ``chunk``, ``pad_id``, ``staged``,
    ``spare``, ``on_prefix`` and the batch's methods."""

    def _stage(self, plan: tuple, prompt_info: dict) -> bool:
        """Stage ``plan`` (work, n, T, max_new) if its prompt hits the prefix cache or exceeds the
        chunk size; True if staged (or failed while staging: answered alone)."""
        from msllm.serving.staged_prefill import StagedPrefill, piece_layout, tokens_computed

        w, n = plan[0], plan[1]
        p, kv = 0, None
        if self.prefix is not None:
            p, kv = self.prefix.lookup(w.job.prompt, count=False)
            if p and tokens_computed(n, p, self.chunk) >= tokens_computed(n, 0, self.chunk):
                p, kv = 0, None              # too short to save work: computed whole
            self.prefix.count(n, p)
            if self.on_prefix is not None:
                self.on_prefix(n, p)
        if not p and not (self.chunk and n > self.chunk):
            return False
        try:
            slots = piece_layout(n, p, self.chunk)[4]
            pool = self.spare.get(slots)
            caches = pool.pop() if pool else self.gen.empty_cache(1, slots)
            prefill = StagedPrefill(self.gen, w.job.prompt, p, kv, self.chunk, self.pad_id, caches)
        except Exception as exc:
            self.fail_work(w, exc)
            return True
        self.staged.append(Staged(plan, prefill, prompt_info.get(id(w))))
        return True

    def _release(self, st: Staged) -> None:
        """Keep a finished staged prefill's cache for the next: one per size up to
        :data:`SPARE_SLOTS` slots (a wider one is allocated again when needed)."""
        if st.prefill.slots > SPARE_SLOTS:
            return
        pool = self.spare.setdefault(st.prefill.slots, [])
        if not pool:
            pool.append(st.prefill.caches)

    def _remember(self, prompt, caches, width: int, row: int, first: int) -> None:
        """Give the prefix cache the whole blocks of ``prompt`` it lacks, read from batch row ``row``
        of ``caches`` (``width`` rows) where prompt token 0 is at slot ``first``. A failure here is
        logged and the prompt is not stored: its request, already decoding, goes on."""
        if self.prefix is None:
            return
        from msllm.serving.staged_prefill import read_slots

        try:
            keys, start = self.prefix.missing(prompt)
            if start < len(keys):
                b = self.prefix.block
                kv = read_slots(caches, width, row, first + start * b, first + len(keys) * b)
                self.prefix.insert(prompt, kv, start)
        except Exception:     # noqa: BLE001 -- the cache is an optimisation; the request is served
            log.exception("serving: storing a prompt's blocks in the prefix cache failed")

    def advance(self) -> bool:
        """The engine's iteration (module docstring): staged pieces, then a decode step of the rows
        (True if there was one)."""
        spent = 0
        while self.staged and (not self.chunk or spent < self.chunk):
            st = self.staged[0]
            if st.work.cancelled.is_set():            # the client is gone before its first token
                self.staged.pop(0)
                self._release(st)
                st.work.tokens = []
                self.on_done(st.work, "cancelled")
                st.work.sink(("done", "cancelled", result(st.work, None, [], "")))
                continue
            try:
                spent += st.prefill.step()
                if st.prefill.done:
                    self.staged.pop(0)
                    self._join(st)
            except Exception as exc:                  # this request alone; the rows go on
                if self.staged and self.staged[0] is st:
                    self.staged.pop(0)
                self.fail_work(st.work, exc)
            if st.prefill.done or st not in self.staged:
                self._release(st)
        if not self.active:
            return False
        self.step()
        return True

    def _join(self, st: Staged) -> None:
        """A staged request's prompt is computed: its slots into a free row, its first token."""
        pf = st.prefill
        w, n, t, max_new = st.plan
        self._fit_for([t + max_new], 1)
        b = next(i for i, r in enumerate(self.rows) if r is None)
        self._write(pf.caches, pf.big_p, [b], len(self.rows), offset=pf.shift)
        try:
            self._start_row(b, st.plan, pf.logits, {id(w): st.prompt_info})
        except Exception:
            self.rows[b] = None
            raise
        self._remember(w.job.prompt, pf.caches, 1, 0, pf.first)


__all__ = ["Staged", "StagedJoins"]
