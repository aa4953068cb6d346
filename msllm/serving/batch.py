"""The serving engine's continuous batch: requests decoding together on one key/value cache, each
in its own row at its own slot, joining as rows free up and leaving when they finish.

Layout. The caches are ``width`` rows of ``buffer`` slots (flat (S * B, K, D) Parameters,
:mod:`msllm.models.llama.kv_cache`). Requests admitted together are prefilled in groups of the
same padded prompt length T (a multiple of 32 tokens; at most :data:`PREFILL_TOKENS` prompt slots
and 1, 2, 4 or 8 rows per group) into a cache of the group's own, whose keys and values are then
written into the requests' rows, slots 0..T-1 (row b's first real slot ``pad``: left padding).
A request's k-th new token is fed at slot T + k with position n + k (n prompt tokens); the slots
it sees follow :mod:`msllm.models.llama.batch_layout` (its key positions: slot - pad).
A decode step runs every row at once, each at its own slot (``cache_index`` with (B, 1) slots);
an empty row is fed the pad token at its slot 0 with every slot hidden (the attention gives it
zeros; its logits are ignored). So a row's logits depend only on its own tokens: a request's
greedy output is the same alone and beside others, whenever it joins.

Growth, and the graphs it compiles. A batch started by one request has one row, else
``max_batch`` rows (a second request widens it to ``max_batch``); its slots are what its
longest request needs, at least :data:`MIN_BUFFER`, else the next power of two (but no more
than the context window plus 32 slots of left padding: :meth:`ContinuousBatch.buffer_for`), and grow the
same way when a longer request joins (new caches, each row's slots written into them). When the
last row finishes the caches are dropped. So the decode graph has few shapes: (1 or
``max_batch`` rows) x (512, 1024, ... slots), each compiled once (a few seconds for SmolLM2);
the prefill compiles once per (group rows, prompt length), whatever the batch. Measured on the
way (``benchmarks/serve_arrivals.py``, ``benchmarks/serve_throughput.py``; BENCHMARKS.md):
prefilling straight into the batch's caches, one graph per (prompt length, rows, slots), and
widths of every power of two, made requests arriving at different moments keep meeting new
shapes, about 4.5 s of compiling each; the cache's slot count itself barely changes a step's time
(masked slots are skipped), so rounding it up costs memory, not speed; prefilling a burst of 8
512-token prompts in groups of 4 instead of one by one gave no more tokens/s and the first
tokens ~2 s later, so only short prompts are grouped (:data:`PREFILL_TOKENS`). A joining
request's prefill runs between two decode steps: the other rows wait for it; a prompt that hits
the prefix cache, or is longer than the chunk size, is prefilled in pieces between decode steps
instead (:mod:`msllm.serving.joining`).

This is the scheduling vLLM calls continuous (iteration-level) batching (Yu et al., "Orca", OSDI
2022): between two decode steps, waiting requests are prefilled into free rows; a finished or
cancelled row is free at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from msllm.generation.passes import pow2_at_least, round_up
from msllm.serving.joining import StagedJoins
from msllm.serving.protocol import result

MIN_BUFFER = 512         # cache slots: at least this, else the next power of two (few decode graphs)
# prompt slots prefilled together at most: enough rows to make a short prompt's prefill a real
# matrix product (one 64-token prompt is mostly operator launches), while a 512-token prompt
# goes alone (measured with 8 such prompts at once: groups of 4 gave no more throughput than one
# by one, and first tokens ~2 s later; benchmarks/serve_throughput.py)
PREFILL_TOKENS = 512


@dataclass
class Row:
    """A request decoding in the batch: its work (job, sink, cancellation), its token decision
    (:class:`~msllm.generation.stepping.RowStep`: sampling, EOS, length) and streamed text
    (:class:`~msllm.generation.stepping.StopText`: stop strings), its place in the cache (``pad``
    first real slot, ``slot`` where its last token went, ``length`` prompt tokens)."""

    work: object
    step: object
    text: object
    pad: int
    slot: int
    length: int
    prompt_info: Optional[list] = None
    info: list = field(default_factory=list)
    last: int = 0
    guide: object = None      # a grammar constraining its tokens (msllm.serving.structured.RowGuide)


class ContinuousBatch(StagedJoins):
    """Rows of requests on one cache (module docstring). Used by the engine's thread only.

    Args:
        gen: the model's :class:`~msllm.generation.decode.Generator`.
        tokenizer, eos (tuple of int), pad_id: as the engine's.
        max_batch: rows at most.
        logprob: ``logprob(logits (V,), token, top) -> (token string, log-probability, top dict)``.
        on_token / on_done: the engine's counters, called per token made (with the row's work) /
            per row finished (with its work and finish reason).
        on_error: ``on_error(work, exception)`` answers one work that failed inside its row (the
            other rows go on).
        prefix_cache: a :class:`~msllm.serving.prefix_cache.PrefixCache` (None: off).
        chunk: most prompt tokens prefilled per iteration for prompts longer than it (a multiple
            of 32; 0: every prompt whole); :mod:`msllm.serving.joining`.
    """

    def __init__(self, gen, tokenizer, eos, pad_id: int, max_batch: int, logprob, on_token, on_done,
                 on_error=None, prefix_cache=None, chunk: int = 0):
        from mindspore import ops

        self.gen, self.config = gen, gen.config
        self.tokenizer, self.eos, self.pad_id = tokenizer, tuple(eos), int(pad_id)
        self.max_batch = int(max_batch)
        self.logprob, self.on_token, self.on_done = logprob, on_token, on_done
        self.on_error = on_error or (lambda work, exc: work.sink(("error", exc)))
        self.guide_for = None    # grammar -> RowGuide, for jobs with a response_format (the engine sets it)
        self.rows: list = []          # width entries: a Row or None
        self.caches = None
        self.buffer = 0
        self.own: dict = {}           # (rows, slots) -> a cache for prefilling (reused)
        self.prefix = prefix_cache    # a PrefixCache, or None (off)
        self.chunk = int(chunk)       # --prefill_chunk_size (0: a prompt is prefilled whole)
        self.on_prefix = None         # on_prefix(queried tokens, hit tokens) (the engine's metrics)
        self.staged: list = []        # Staged: requests being prefilled in pieces, in arrival order
        self.spare: dict = {}         # slots -> one-row caches the staged prefills reuse
        self.scatter = ops.ScatterUpdate()

    # ---- state --------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def pending(self) -> int:
        """Rows decoding plus requests still being prefilled in pieces."""
        return self.active + len(self.staged)

    @property
    def free(self) -> int:
        return self.max_batch - self.pending

    def drop(self) -> None:
        """Forget every row and give the caches back (after the last row or a failure); staged
        prefills stay."""
        if self.caches is not None:
            self.gen.release_cache(self.caches)
        self.rows, self.caches, self.buffer = [], None, 0

    def fail(self, error) -> None:
        """Answer every row and staged prefill with ``("error", error)`` and drop them."""
        for r in self.rows:
            if r is not None:
                r.work.sink(("error", error))
        for st in self.staged:
            st.work.sink(("error", error))
        self.staged = []
        self.drop()

    # ---- admitting ----------------------------------------------------------------------------
    def admit(self, works: list, prompt_info: dict) -> None:
        """Prefill ``works`` (at most :attr:`free`, each with ``max_tokens`` > 0) into free rows,
        widening the caches if needed, and emit each one's first token. A work whose row cannot be
        set up, or whose prefill group fails, is answered with an error alone (:meth:`fail_work`);
        the rows already decoding and the caches are kept."""
        plans = []
        for w in works:
            n = len(w.job.prompt)
            if n == 0:     # the app refuses empty prompts; never divide by a zero length below
                self.fail_work(w, ValueError("empty prompt"))
                continue
            # a row can reach its prompt plus the new tokens the context leaves; nothing beyond
            max_new = min(w.job.max_tokens, self.gen.context - n)
            plans.append((w, n, round_up(n), max_new))
        plans = [plan for plan in plans if not self._stage(plan, prompt_info)]
        if not plans:
            return
        self._fit_for([t + m for _, _, t, m in plans], len(plans))
        for group in self._groups(plans):
            free = [b for b, r in enumerate(self.rows) if r is None][:len(group)]
            try:
                logits, own = self._prefill(free, [w.job.prompt for w, *_ in group], group[0][2])
            except Exception as exc:     # this group's rows were never set: the others go on
                for w, *_ in group:
                    self.fail_work(w, exc)
                continue
            for i, (b, plan, row_logits) in enumerate(zip(free, group, logits)):
                try:
                    self._start_row(b, plan, row_logits, prompt_info)
                    self._remember(plan[0].job.prompt, own, len(group), i, group[0][2] - plan[1])
                except Exception as exc:
                    self.rows[b] = None
                    self.fail_work(plan[0], exc)

    def _fit_for(self, needs: list, joining: int) -> None:
        """Caches for the rows decoding plus ``joining`` more whose last slots are ``needs`` - 1:
        1 row for a request alone, else ``max_batch`` rows; slots by :meth:`buffer_for`."""
        need = max([r.pad + r.length + r.step.max_new for r in self.rows if r is not None] + list(needs))
        rows = 1 if self.pending + joining == 1 else self.max_batch
        self._fit(rows, self.buffer_for(need))

    def buffer_for(self, need: int) -> int:
        """Cache slots for rows reaching slot ``need`` - 1: at least :data:`MIN_BUFFER`, else the next
        power of two (few decode graphs), but never more than the context window plus the largest
        left padding (31 slots) can use: a long request does not double the cache."""
        cap = round_up(self.gen.context + 1)
        return max(need, min(pow2_at_least(need, MIN_BUFFER), cap))

    def _start_row(self, b: int, plan: tuple, row_logits: np.ndarray, prompt_info: dict) -> None:
        """Row ``b`` for ``plan`` (work, n, T, max_new) after its prefill, and its first token."""
        from msllm.config_generation import DecodeSettings
        from msllm.generation.stepping import RowStep, StopText

        w, n, t, max_new = plan
        j = w.job
        settings = DecodeSettings(do_sample=not j.greedy, temperature=j.temperature, top_k=j.top_k,
                                  top_p=j.top_p, eos_token_id=self.eos, pad_token_id=self.pad_id)
        rng = np.random.default_rng(j.seed) if not j.greedy else None
        self.rows[b] = Row(w, RowStep(settings, max_new, rng, j.prompt), StopText(self.tokenizer, self.eos, j.stop),
                           pad=t - n, slot=t - 1, length=n, prompt_info=prompt_info.get(id(w)),
                           guide=self.guide_for(j.grammar) if j.grammar is not None else None)
        w.tokens = []
        self._accept(b, row_logits)

    def fail_work(self, work, exc: BaseException) -> None:
        """Answer one work with the engine's error for ``exc`` (``on_error``: an ApiError, the
        request's own fault, as it is; anything else a generic 500 and the traceback to the log):
        that row alone fails."""
        self.on_error(work, exc)

    def _groups(self, plans: list) -> list:
        """``plans`` (work, n, T, max_new) -> prefill groups: requests of the same padded length T
        (in arrival order), at most :data:`PREFILL_TOKENS` // T of them, split into powers of two
        (1, 2, 4, 8 rows: few prefill graphs)."""
        by_length: dict = {}
        for p in plans:
            by_length.setdefault(p[2], []).append(p)
        out = []
        for t, same in by_length.items():
            cap = max(1, min(self.max_batch, PREFILL_TOKENS // max(t, 1)))
            i = 0
            while i < len(same):
                k = 1 << (min(cap, len(same) - i).bit_length() - 1)       # a power of two <= what is left
                out.append(same[i:i + k])
                i += k
        return out

    def _fit(self, width: int, buffer: int) -> None:
        """Caches of at least ``width`` rows and ``buffer`` slots, keeping the rows' contents: the
        generator's caches of that shape (:meth:`Generator.lease_cache`: the kept set, whose decode
        step holds it, or new zero caches), the old rows written into them at their rows and
        slots, the old caches given back. Slots no row has written are hidden from every row."""
        width, buffer = max(width, len(self.rows)), max(buffer, self.buffer)
        if self.caches is None or (width, buffer) != (len(self.rows), self.buffer):
            old, old_w, old_s = self.caches, len(self.rows), self.buffer
            self.caches = self.gen.lease_cache(width, buffer)
            if old is not None:
                self._write(old, old_s, range(old_w), width)
                self.gen.release_cache(old)
        self.rows += [None] * (width - len(self.rows))
        self.buffer = buffer

    def _write(self, sources, slots: int, rows, width: int, offset: int = 0) -> None:
        """Slots ``offset`` .. ``offset`` + ``slots`` - 1 of every row of ``sources`` (caches (S' * k,
        K, D), slot-major, k = len(``rows``)) into slots 0..``slots``-1 of batch rows ``rows`` of the
        batch's caches (``width`` rows), in place (``ScatterUpdate`` run eagerly: no graph per shape)."""
        import mindspore as ms

        from msllm.models.llama.kv_cache import cache_index

        rows = list(rows)
        index = ms.Tensor(cache_index(np.arange(slots), width, rows))             # (slots, k)
        a, n = offset * len(rows), slots * len(rows)
        for dst, src in zip(self.caches, sources):
            self.scatter(dst, index, src[a:a + n].reshape((slots, len(rows)) + tuple(src.shape[1:])))

    def _prefill(self, rows: list, prompts: list, t: int) -> np.ndarray:
        """The k ``prompts`` (left-padded to T slots) into a k-row cache of their own (a graph per
        (k, T), whatever the batch's shape; the cache, of :data:`MIN_BUFFER` or the next power of
        two slots, is kept and reused: a prefill writes slots 0..T-1 and reads nothing else), then
        their keys and values into batch rows ``rows``' slots 0..T-1 (``ScatterUpdate``, in place,
        run eagerly: no graph per batch shape). Returns (the last prompt tokens' logits (k, V), the
        k-row cache)."""
        from msllm.models.llama.batch_layout import key_positions, left_pad, positions_for

        k = len(rows)
        size = pow2_at_least(t, MIN_BUFFER)
        own = self.own.get((k, size))
        if own is None:
            own = self.own[(k, size)] = self.gen.empty_cache(k, size)
        ids, pads = left_pad(prompts, t, self.pad_id)
        slots = np.arange(t)
        logits, _ = self.gen.run("prefill", ids, positions_for(pads, slots), key_positions(pads, t), slots, own)
        self._write(own, t, rows, len(self.rows))
        return logits, own

    # ---- decoding -----------------------------------------------------------------------------
    def step(self) -> None:
        """Drop cancelled rows, then one decode step of every row, each at its own next slot."""
        for b, r in enumerate(self.rows):
            if r is not None and r.work.cancelled.is_set():   # the client is gone: the row stops here
                self._finish(b, "cancelled")
        if not self.active:
            return self.drop()
        from msllm.models.llama.batch_layout import key_positions, positions_for

        width = len(self.rows)
        tokens = np.full(width, self.pad_id, np.int32)
        slots = np.zeros(width, np.int64)
        pads = np.full(width, -1, np.int64)      # an empty row: a negative pad, every slot hidden
        for b, r in enumerate(self.rows):
            if r is None:
                continue
            r.slot += 1
            tokens[b], slots[b], pads[b] = r.last, r.slot, r.pad
        logits, _ = self.gen.run("decode", tokens[:, None], positions_for(pads, slots[:, None]),
                                 key_positions(pads, self.buffer), slots[:, None], self.caches)
        for b, r in enumerate(self.rows):
            if r is not None:
                try:
                    self._accept(b, logits[b])
                except Exception as exc:    # this row alone: the other rows and the caches go on
                    if self.rows[b] is r:
                        self.rows[b] = None
                    self.fail_work(r.work, exc)
        if not self.active:
            self.drop()

    def _accept(self, b: int, logits_row: np.ndarray) -> None:
        """Row b's next token from its logits (V,) (:mod:`msllm.generation.stepping`; a grammar, if
        any, masks the logits first): choose, stream the text that became final, finish the row at
        EOS, a stop string, ``max_tokens`` or the context's end."""
        r = self.rows[b]
        scores = logits_row if r.guide is None else r.guide.mask(logits_row)    # grammar: others at -inf
        tok = r.step.choose(scores)
        if r.guide is not None and tok in self.eos:
            r.guide.finish()           # a "stop" answer parses: 400 for this row otherwise
        elif r.guide is not None:
            r.guide.accept(tok)
        r.last = tok
        r.work.tokens.append(tok)
        self.on_token(r.work)
        if r.work.job.logprobs is not None:
            r.info.append(self.logprob(logits_row, tok, r.work.job.logprobs))
        finish = r.step.accept(tok)
        piece, stopped = r.text.push(tok)
        if stopped:
            r.step.stop()
        elif finish is not None:
            piece += r.text.finish()
        if piece:
            r.work.sink(("text", piece, None))
        if r.step.finished:   # OpenAI's finish_reason: "stop" for EOS as for a stop string
            self._finish(b, "stop" if r.step.reason == "eos" else r.step.reason)

    def _finish(self, b: int, reason: str) -> None:
        r = self.rows[b]
        self.rows[b] = None
        self.on_done(r.work, reason)
        r.work.sink(("done", reason, result(r.work, r.prompt_info, r.info, r.text.text)))
