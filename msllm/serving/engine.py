"""The server's decoding engine: one thread owns the model and runs the jobs that arrive together
as one batch on the key/value cache (static batching with a collection window).

A job waits in a bounded queue (full: :class:`QueueFull`, answered 429). The engine thread takes
the first job, then gathers more until ``window_s`` seconds pass without a new one (a burst of
clients forms one batch; at most :data:`BURST_WINDOWS` windows after the first job) or until
``max_batch`` jobs, and decodes them together (:class:`msllm.generation.passes.Passes`: left-padded rows, each row masked
to its own tokens and positions, so a row's logits do not depend on the other rows'). Each row
chooses its tokens with its own settings and random generator (temperature, top-k, top-p, seed:
:func:`msllm.generation.processors.choose` on that row alone), stops at its own EOS ids, stop
strings (cut from the text; text that could start a stop string is held back while streaming, as
``tools/chat.py`` does) or ``max_tokens``; a cancelled job (client gone) stops at the next step
and frees nothing else. The batch ends when every row has; then the next batch starts.

Log-probabilities: of generated tokens from each step's raw logits; of the prompt (``echo`` with
``logprobs``) from one forward pass over the prompt (right-padded to a multiple of 32 tokens: a
causal model's logits at a position do not depend on later positions), position i scored from
the logits at i - 1, as lm-evaluation-harness and msllm's evaluation score a continuation.

Events go to each job's ``sink(event)`` (called from the engine thread; the app forwards them to
its event loop): ``("text", piece, token_info)`` as text becomes final, then ``("done", finish_reason,
result)``, or ``("error", ApiError)``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from msllm.generation.chat import _held_back   # the start of a stop string, held back while streaming
from msllm.serving.protocol import ApiError, Job

log = logging.getLogger("msllm")
SCORE_MULTIPLE = 32

# a batch being gathered waits at most this many windows after its first job
BURST_WINDOWS = 10


class QueueFull(Exception):
    """The engine's queue holds ``max_queue`` jobs."""


@dataclass
class Work:
    """A job in the engine: its sink, cancellation flag and what it produced."""

    job: Job
    sink: Callable
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokens: list = field(default_factory=list)

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    """Owns ``net`` (a loaded ``LlamaForCausalLM``) and its tokenizer; see the module docstring.

    Args:
        net, config: the model and its :class:`~msllm.models.llama.config.LlamaConfig`.
        tokenizer: msllm's tokenizer (``decode``, ``id_to_token``, ``eos_ids``).
        eos_ids: the ids that end a row; pad_id: fed to finished rows.
        max_batch: rows per batch; window_s: how long a batch being gathered waits for one more job;
        max_queue: jobs waiting at most (more: :class:`QueueFull`).
    """

    def __init__(self, net, config, tokenizer, eos_ids, pad_id: int, max_batch: int = 8, window_s: float = 0.02,
                 max_queue: int = 64):
        from msllm.generation.decode import generator_for

        self.net, self.config, self.tokenizer = net, config, tokenizer
        self.gen = generator_for(net, config)
        self.eos = tuple(int(e) for e in eos_ids)
        self.pad_id = int(pad_id)
        self.max_batch, self.window_s = max_batch, window_s
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.running = True
        self.busy = threading.Event()
        self.batches = 0                 # batches run, rows per batch, tokens made, rows cancelled
        self.batch_sizes: list = []
        self.tokens_generated = 0
        self.cancelled_rows = 0
        self.thread = threading.Thread(target=self._loop, name="msllm-engine", daemon=True)

    # ---- life -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for ``GET /health``: batches, the largest batch, tokens generated, rows
        cancelled, jobs waiting, whether a batch is running."""
        return {"batches": self.batches, "max_batch_seen": max(self.batch_sizes, default=0),
                "tokens_generated": self.tokens_generated, "cancelled_rows": self.cancelled_rows,
                "queued": self.queue.qsize(), "busy": self.busy.is_set()}

    def start(self) -> None:
        self.thread.start()

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

    def _loop(self) -> None:
        while self.running or not self.queue.empty():
            try:
                first = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
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
                # split batch runs twice as long: benchmarks/serve_throughput.py)
                deadline = min(time.monotonic() + self.window_s, start + BURST_WINDOWS * self.window_s)
            self.busy.set()
            try:
                self.run_batch(batch)
            except Exception as exc:   # one failed batch answers its jobs with 500, the server goes on
                log.exception("serving: batch of %d failed", len(batch))
                for w in batch:
                    w.sink(("error", ApiError(500, f"generation failed: {type(exc).__name__}: {exc}")))
            finally:
                self.busy.clear()

    # ---- one batch --------------------------------------------------------------------------
    def run_batch(self, batch: list) -> None:
        live = [w for w in batch if not w.cancelled.is_set()]
        self.batches += 1
        self.batch_sizes.append(len(live))
        prompt_info = {id(w): self.score_prompt(w.job) for w in live if w.job.echo and w.job.logprobs is not None}
        gen = [w for w in live if w.job.max_tokens > 0]
        for w in live:
            if w.job.max_tokens == 0:
                w.sink(("done", "length", self._result(w, prompt_info.get(id(w)), [], "")))
        if gen:
            self.decode(gen, prompt_info)

    def decode(self, rows: list, prompt_info: dict) -> None:
        from msllm.generation import processors
        from msllm.generation.api import TextStream
        from msllm.generation.config import DecodeSettings
        from msllm.generation.passes import Passes

        prompts = [w.job.prompt for w in rows]
        max_new = max(w.job.max_tokens for w in rows)
        base = DecodeSettings(max_new_tokens=max_new, eos_token_id=self.eos, pad_token_id=self.pad_id)
        length, max_new, buffer = self.gen.layout(prompts, base)
        passes = Passes(self.gen, prompts, base, length, max_new, buffer)
        settings, rngs = [], []
        for w in rows:
            j = w.job
            settings.append(DecodeSettings(do_sample=not j.greedy, temperature=j.temperature, top_k=j.top_k,
                                           top_p=j.top_p, eos_token_id=self.eos, pad_token_id=self.pad_id))
            rngs.append(np.random.default_rng(j.seed) if not j.greedy else None)
        streams = [TextStream(self.tokenizer, self.eos) for _ in rows]
        shown = [""] * len(rows)
        info = [[] for _ in rows]          # per generated token: (token string, logprob, top dict)
        finished = [False] * len(rows)
        logits = passes.logits
        out = [[] for _ in rows]
        for k in range(max_new):
            tokens = np.full(len(rows), self.pad_id, np.int64)
            for r, w in enumerate(rows):
                if finished[r]:
                    continue
                if w.cancelled.is_set():   # the client is gone: the row stops here
                    finished[r] = True
                    self.cancelled_rows += 1
                    w.tokens = out[r]
                    w.sink(("done", "cancelled", self._result(w, prompt_info.get(id(w)), info[r], shown[r])))
                    continue
                row = logits[r:r + 1]
                tok = int(processors.choose(row, settings[r], rngs[r])[0])
                tokens[r] = tok
                out[r].append(tok)
                self.tokens_generated += 1
                if w.job.logprobs is not None:
                    info[r].append(self._token_logprob(row[0], tok, w.job.logprobs))
                finish = None
                if tok in self.eos:
                    finish = "stop"
                streams[r].push(tok)
                text = streams[r].text
                stop_at = min((text.find(s) for s in w.job.stop if s in text), default=-1)
                if stop_at >= 0:
                    text, finish = text[:stop_at], "stop"
                elif finish is None and len(out[r]) >= w.job.max_tokens:
                    finish = "length"
                if finish is None:   # hold back an unfinished character or the start of a stop string
                    if text.endswith("\ufffd"):
                        text = text[:len(shown[r])]
                    text = text[:len(text) - _held_back(text, w.job.stop)]
                if len(text) > len(shown[r]) and text.startswith(shown[r]):
                    w.sink(("text", text[len(shown[r]):], None))
                    shown[r] = text
                if finish is not None:
                    finished[r] = True
                    w.tokens = out[r]
                    w.sink(("done", finish, self._result(w, prompt_info.get(id(w)), info[r], shown[r])))
            if all(finished) or k == max_new - 1:
                break
            logits = passes.next(k, tokens, lambda: [p + o for p, o in zip(prompts, out)])
        for r, w in enumerate(rows):   # rows cut by the context window end here
            if not finished[r]:
                w.tokens = out[r]
                w.sink(("done", "length", self._result(w, prompt_info.get(id(w)), info[r], shown[r])))

    # ---- log-probabilities ----------------------------------------------------------------
    def _piece(self, tok: int) -> str:
        piece = self.tokenizer.id_to_token(int(tok))
        return piece if piece is not None else f"<{int(tok)}>"

    def _token_logprob(self, logits_row: np.ndarray, tok: int, top: int):
        """(token string, log-probability, {token: logprob} of the top ``top`` and the token)."""
        from msllm.generation.processors import log_softmax

        lp = log_softmax(logits_row[None].astype(np.float32))[0]
        d = {self._piece(t): float(lp[t]) for t in np.argsort(-lp, kind="stable")[:top]} if top else {}
        d[self._piece(tok)] = float(lp[tok])
        return self._piece(tok), float(lp[tok]), d

    def score_prompt(self, job: Job) -> list:
        """Per prompt token (string, log-probability given the tokens before it (None for the
        first), top dict): one forward pass over the prompt (module docstring)."""
        import mindspore as ms

        from msllm.generation.passes import round_up

        ids = job.prompt
        width = round_up(len(ids), SCORE_MULTIPLE)
        x = np.full((1, width), self.pad_id, np.int32)
        x[0, :len(ids)] = ids
        logits = self.net(ms.Tensor(x)).asnumpy()[0]             # (W, V) float32
        rows = [(self._piece(ids[0]), None, None)]
        for i in range(1, len(ids)):
            rows.append(self._token_logprob(logits[i - 1], ids[i], job.logprobs or 0))
        return rows

    def _result(self, w: Work, prompt_rows: Optional[list], gen_rows: list, text: str) -> dict:
        """What the app needs to answer a finished job."""
        return {"text": text, "completion_tokens": len(w.tokens), "prompt_tokens": len(w.job.prompt),
                "prompt_logprobs": prompt_rows, "logprobs": gen_rows}


__all__ = ["Engine", "QueueFull", "Work"]
