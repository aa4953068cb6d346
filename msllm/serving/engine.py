"""The server's decoding engine: one thread owns the model and decodes the requests in one
continuous batch on the key/value cache (:mod:`msllm.serving.batch`): between two decode steps,
waiting requests are prefilled into free rows; a row that finishes or is cancelled is free at the
next step.

A job waits in a bounded queue (full: :class:`QueueFull`, answered 429). When the engine is idle
it takes the first job, then gathers more until ``window_s`` seconds pass without a new one (a
burst of clients starts one batch as wide as it needs; at most :data:`BURST_WINDOWS` windows
after the first job) or until ``max_batch`` jobs; while rows are decoding, it takes whatever
waits, up to the free rows, before each step. Each row chooses its tokens with its own settings
and random generator (temperature, top-k, top-p, seed: :func:`msllm.generation.processors.choose`
on that row alone), stops at its own EOS ids, stop strings (cut from the text; text that could
start a stop string is held back while streaming, as ``tools/chat.py`` does) or ``max_tokens``;
a cancelled job (client gone) stops at the next step and frees its row.

Log-probabilities: of generated tokens from each step's raw logits; of the prompt (``echo`` with
``logprobs``) from one forward pass over the prompt (right-padded to a power of two of at least 32
tokens, so that few graphs are compiled: a causal model's logits at a position do not depend on
later positions), position i scored from the logits at i - 1, as lm-evaluation-harness and msllm's
evaluation score a continuation. That pass runs on the engine thread between decode steps, so the
app caps the prompts it scores (``Limits.max_echo_logprobs_tokens``).

Events go to each job's ``sink(event)`` (called from the engine thread; the app forwards them to
its event loop): ``("text", piece, token_info)`` as text becomes final, then ``("done", finish_reason,
result)``, or ``("error", ApiError)``.

Failures. A failure inside one row (setting it up, its prefill group, choosing its token) answers
that job alone with a 500 whose message is generic (:data:`GENERATION_FAILED`; MindSpore's internal
text stays in the server's log with the traceback), or, when the request itself is the cause (a
``response_format`` schema the grammar engine cannot follow to its end), with that
:class:`~msllm.serving.protocol.ApiError`; the other rows and the caches go on. Only a
failed decode step, which computes every row at once, answers every row in the batch so. The
thread's state is :meth:`Engine.alive` (``GET /health`` answers 503 when it is not).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from msllm.serving.batch import ContinuousBatch
from msllm.serving.protocol import ApiError, Job, result

log = logging.getLogger("msllm")
SCORE_MULTIPLE = 32

# a batch being gathered from idle waits at most this many windows after its first job
BURST_WINDOWS = 10


class QueueFull(Exception):
    """The engine's queue holds ``max_queue`` jobs."""


GENERATION_FAILED = "the server failed while generating this choice; the error is in the server's log"


def generation_error() -> ApiError:
    """The 500 a client gets for a failure inside the engine (no internal text)."""
    return ApiError(500, GENERATION_FAILED, code="generation_failed")


@dataclass
class Work:
    """A job in the engine: its sink, cancellation flag and what it produced; ``t_submit`` /
    ``t_last`` (``time.monotonic()`` seconds) when it was queued / made its last token."""

    job: Job
    sink: Callable
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokens: Optional[list] = None     # set when the job starts decoding
    t_submit: float = field(default_factory=time.monotonic)
    t_last: Optional[float] = None

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    """Owns ``net`` (a loaded ``LlamaForCausalLM``) and its tokenizer; see the module docstring.

    Args:
        net, config: the model and its :class:`~msllm.models.llama.config.LlamaConfig`.
        tokenizer: msllm's tokenizer (``decode``, ``id_to_token``, ``eos_ids``).
        eos_ids: the ids that end a row; pad_id: fed to finished rows.
        max_batch: rows decoding at once; window_s: when idle, how long a batch being gathered
        waits for one more job; max_queue: jobs waiting at most (more: :class:`QueueFull`).
        metrics: a :class:`~msllm.serving.metrics.ServerMetrics` (default: a new one).
        prefix_cache_bytes: the prefix cache's capacity (:mod:`msllm.serving.prefix_cache`); 0: no
            prefix cache (``--enable_prefix_caching`` off).
        prefill_chunk_size: prompts longer than this many tokens are prefilled in pieces of it
            between decode steps (:mod:`msllm.serving.joining`); 0: every prompt whole.

    Raises:
        ValueError: ``prefill_chunk_size`` is not 0 or a positive multiple of 32, or
            ``prefix_cache_bytes`` is negative.
    """

    def __init__(self, net, config, tokenizer, eos_ids, pad_id: int, max_batch: int = 8, window_s: float = 0.02,
                 max_queue: int = 64, metrics=None, prefix_cache_bytes: int = 0, prefill_chunk_size: int = 0):
        from msllm.generation.decode import generator_for
        from msllm.serving.metrics import ServerMetrics

        self.net, self.config, self.tokenizer = net, config, tokenizer
        self.gen = generator_for(net, config)
        self.eos = tuple(int(e) for e in eos_ids)
        self.pad_id = int(pad_id)
        self.max_batch, self.window_s = max_batch, window_s
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.running = True
        self.busy = threading.Event()
        # batches started from idle, most rows at once, jobs that joined a running batch,
        # decode steps, tokens made, rows cancelled
        self.batches = 0
        self.max_rows = 0
        self.joined = 0
        self.steps = 0
        self.tokens_generated = 0
        self.cancelled_rows = 0
        self.failed_rows = 0
        self.warming = False          # warm-up's tokens count in no metric
        self.crash: Optional[BaseException] = None     # what ended the thread, if anything did
        self.metrics = metrics if metrics is not None else ServerMetrics()
        if prefill_chunk_size < 0 or prefill_chunk_size % 32:
            raise ValueError(f"prefill_chunk_size must be 0 (off) or a positive multiple of 32, got {prefill_chunk_size}")
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0 (0: off), got {prefix_cache_bytes}")
        from msllm.serving.prefix_cache import PrefixCache

        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self.batch = ContinuousBatch(self.gen, tokenizer, self.eos, self.pad_id, max_batch, self._token_logprob,
                                     self._count_token, self._count_done, self._row_failed,
                                     self.prefix_cache, prefill_chunk_size)
        self.batch.on_prefix = self._count_prefix
        self.metrics.bind(self)
        from msllm.serving.structured import StructuredOutput

        self.structured = StructuredOutput(tokenizer, config.vocab_size, self.eos)
        self.batch.guide_for = self.structured.guide
        self.thread = threading.Thread(target=self._run, name="msllm-engine", daemon=True)

    # ---- life -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for ``GET /health``: batches started from idle, the most rows decoding at once,
        jobs that joined a running batch, decode steps, tokens generated, rows cancelled, jobs
        waiting, whether rows are decoding."""
        return {"batches": self.batches, "max_batch_seen": self.max_rows, "joined_running": self.joined,
                "steps": self.steps, "tokens_generated": self.tokens_generated,
                "cancelled_rows": self.cancelled_rows, "failed_rows": self.failed_rows,
                "queued": self.queue.qsize(), "busy": self.busy.is_set()}

    def alive(self) -> bool:
        """The engine thread is running (started, not ended, not crashed)."""
        return self.thread.is_alive() and self.crash is None

    def _count_token(self, work) -> None:
        self.tokens_generated += 1
        if not self.warming:
            self.metrics.on_token(work)

    def _count_prefix(self, queried: int, hit: int) -> None:
        if not self.warming:
            self.metrics.on_prefix(queried, hit)

    def _count_done(self, work, reason: str) -> None:
        if reason == "cancelled":
            self.cancelled_rows += 1
        if not self.warming:
            self.metrics.on_done(work, reason)

    def _row_failed(self, work, exc: BaseException) -> None:
        """One job failed inside its row: an ApiError (the request's own fault, its message written
        for the client) goes to its client as it is; anything else puts the traceback in the log and
        a generic 500 to the client."""
        self.failed_rows += 1
        self.metrics.on_error(work)
        if isinstance(exc, ApiError):
            log.warning("serving: one row failed: %s", exc.message)
            work.sink(("error", exc))
            return
        log.error("serving: one row failed (%d prompt tokens); the other rows go on", len(work.job.prompt),
                  exc_info=exc)
        work.sink(("error", generation_error()))

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:    # noqa: BLE001 -- recorded for /health, then re-raised
            self.crash = exc
            log.exception("serving: the engine thread died")
            raise

    def stop(self, timeout: float = 600.0) -> None:
        """Finish the queued and running jobs, then end the thread (the server's drain)."""
        self.running = False
        self.thread.join(timeout)

    def submit(self, job: Job, sink: Callable) -> Work:
        """Queue ``job``; raises :class:`QueueFull` when the queue is full, ApiError 503 when stopping."""
        if not self.running:
            raise ApiError(503, "the server is shutting down")
        work = Work(job, sink)
        try:
            self.queue.put_nowait(work)
        except queue.Full:
            raise QueueFull() from None
        return work

    def _gather(self) -> list:
        """Idle: the first job, then the rest of its burst (module docstring); [] after 0.1 s."""
        try:
            first = self.queue.get(timeout=0.1)
        except queue.Empty:
            return []
        batch = [first]
        start = time.monotonic()
        deadline = start + self.window_s
        while len(batch) < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(self.queue.get(timeout=left))
            except queue.Empty:
                break
            # still arriving: one more window after each job, BURST_WINDOWS windows at most (8
            # streaming clients started together reached a 20 ms window over 20-60 ms, and a
            # batch that starts narrow has to widen its caches and compile again)
            deadline = min(time.monotonic() + self.window_s, start + BURST_WINDOWS * self.window_s)
        return batch

    def _waiting(self, n: int) -> list:
        """Up to ``n`` jobs already waiting (no wait)."""
        out = []
        while len(out) < n:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return out

    def _loop(self) -> None:
        while self.running or not self.queue.empty() or self.batch.pending:
            running = self.batch.pending > 0
            new = self._waiting(self.batch.free) if running else self._gather()
            if not new and not running:
                continue
            self.busy.set()
            try:
                if new:
                    if running:
                        self.joined += len(new)
                    else:
                        self.batches += 1
                    self.admit(new)
                if self.batch.pending:
                    # staged prefill pieces, then a decode step of the rows
                    self.steps += self.batch.advance()
            except Exception:   # a failed decode step answers every row with 500, the server goes on
                log.exception("serving: a decode step of %d rows failed", self.batch.active)
                err = generation_error()
                self.failed_rows += self.batch.pending
                staged = {id(st.work) for st in self.batch.staged}
                self.batch.fail(err)
                for w in new:
                    if w.tokens is None and id(w) not in staged:
                        w.sink(("error", err))
            finally:
                if not self.batch.pending:   # every row done (some may finish at their first token)
                    self.batch.drop()
                    self.busy.clear()

    def admit(self, works: list) -> None:
        """Jobs taken from the queue: cancelled ones are dropped, ``max_tokens`` = 0 ones answered
        at once (after scoring the prompt for ``echo``), the rest prefilled into the batch. A job
        that fails here fails alone (:meth:`_row_failed`)."""
        prompt_info, gen = {}, []
        for w in works:
            if w.cancelled.is_set():
                continue
            self.metrics.on_admit(w)
            try:
                if w.job.echo and w.job.logprobs is not None:
                    prompt_info[id(w)] = self.score_prompt(w.job)
                if w.job.max_tokens == 0:
                    w.tokens = []
                    w.sink(("done", "length", result(w, prompt_info.get(id(w)), [], "")))
                    continue
            except Exception as exc:
                self._row_failed(w, exc)
                continue
            gen.append(w)
        if gen:
            self.batch.admit(gen, prompt_info)
            self.max_rows = max(self.max_rows, self.batch.active)

    def warmup(self, slots: int = 512) -> list:
        """Before :meth:`start`: run the shapes requests meet first through the real path (one
        short request alone: prefill (1 row, 32 slots) and decode (1 row, 512 slots); then
        ``max_batch`` short ones at once: their grouped prefill and the decode at ``max_batch``
        rows), then the wider caches' decode step up to ``slots`` and the prefix cache's and
        chunked prefill's pieces (:func:`msllm.serving.warmup.warm_shapes`), so the first clients
        do not wait for graph compilation (a few seconds per shape). Returns the compiled
        (kind, rows, tokens, slots) shapes with their first-call seconds."""
        from msllm.serving.warmup import run_shapes, warm_shapes

        if self.thread.is_alive():
            raise RuntimeError("warmup() runs before start()")
        before = set(self.gen.first_call_s)
        self.warming = True
        prompt = [self.pad_id if self.pad_id not in self.eos else 0] * 8
        for count in (1, self.max_batch):
            sinks = [(lambda ev: None) for _ in range(count)]
            self.batch.admit([Work(Job(list(prompt), 2), s) for s in sinks], {})
            while self.batch.active:
                self.batch.step()
            self.batch.drop()
        more = warm_shapes(self.max_batch, self.batch.chunk, self.prefix_cache is not None, slots)
        run_shapes(self.gen, [k for k in more if k not in self.gen.first_call_s], self.pad_id)
        self.warming, self.tokens_generated = False, 0
        return [(k, self.gen.first_call_s[k]) for k in self.gen.first_call_s if k not in before]

    # ---- log-probabilities ----------------------------------------------------------------
    def _piece(self, tok: int) -> str:
        piece = self.tokenizer.id_to_token(int(tok))
        return piece if piece is not None else f"<{int(tok)}>"

    def _token_logprob(self, logits_row: np.ndarray, tok: int, top: int):
        """(token string, log-probability, {token: logprob} of the top ``top`` and the token,
        token id, [(id, logprob)] of the top ``top`` in order): completions read the first three
        (vocabulary pieces), chat the ids (decoded to text)."""
        from msllm.generation.processors import log_softmax

        lp = log_softmax(logits_row[None].astype(np.float32))[0]
        best = [int(t) for t in np.argsort(-lp, kind="stable")[:top]] if top else []
        d = {self._piece(t): float(lp[t]) for t in best}
        d[self._piece(tok)] = float(lp[tok])
        return self._piece(tok), float(lp[tok]), d, int(tok), [(t, float(lp[t])) for t in best]

    def score_prompt(self, job: Job) -> list:
        """Per prompt token (string, log-probability given the tokens before it (None for the
        first), top dict): one forward pass over the prompt (module docstring)."""
        import mindspore as ms

        ids = job.prompt
        width = max(SCORE_MULTIPLE, 1 << (len(ids) - 1).bit_length())   # a power of two: few graphs
        x = np.full((1, width), self.pad_id, np.int32)
        x[0, :len(ids)] = ids
        logits = self.net(ms.Tensor(x)).asnumpy()[0]             # (W, V) float32
        rows = [(self._piece(ids[0]), None, None)]
        for i in range(1, len(ids)):
            rows.append(self._token_logprob(logits[i - 1], ids[i], job.logprobs or 0))
        return rows


__all__ = ["Engine", "QueueFull", "Work"]
