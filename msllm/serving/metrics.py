"""Prometheus metrics of the server (``GET /metrics``), through ``prometheus-client``.

Names are vLLM's (``vllm/v1/metrics/loggers.py``; its docs' "Metrics" page) with msllm's prefix,
so a vLLM dashboard works after replacing ``vllm:`` by ``msllm:``:

========================================  =========  ===============================================
``msllm:num_requests_running``            gauge      rows decoding in the continuous batch
``msllm:num_requests_waiting``            gauge      jobs in the engine's queue
``msllm:prompt_tokens_total``             counter    prompt tokens prefilled
``msllm:generation_tokens_total``         counter    tokens generated
``msllm:request_success_total``           counter    finished jobs, label ``finished_reason``
                                                     (stop, length, cancelled; vLLM: abort)
``msllm:request_failure_total``           counter    jobs answered with an error (msllm's own)
``msllm:time_to_first_token_seconds``     histogram  queued -> first token, seconds
``msllm:inter_token_latency_seconds``     histogram  between two tokens of one row, seconds
``msllm:e2e_request_latency_seconds``     histogram  queued -> finished, seconds
``msllm:kv_cache_usage_perc``             gauge      cache slots holding a row's tokens / slots
                                                     allocated (0..1; vLLM: blocks in use)
``msllm:kv_cache_slots_in_use``           gauge      cache slots holding a row's tokens (msllm's own)
``msllm:prefix_cache_queries_total``      counter    prompt tokens looked up in the prefix cache
``msllm:prefix_cache_hits_total``         counter    of those, tokens found (reused, not computed)
``msllm:prefix_cache_blocks``             gauge      blocks held (msllm's own; 32 tokens each)
``msllm:prefix_cache_bytes``              gauge      their size, bytes (msllm's own)
========================================  =========  ===============================================

A "job" is one choice (a request with ``n`` = 2 or two prompts is two jobs). Each server gets its
own ``CollectorRegistry`` (no process-global state: tests build several applications).
"""

from __future__ import annotations

import time

# vLLM's bucket edges (vllm/v1/metrics/loggers.py), seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The metrics above; the engine calls :meth:`on_admit`, :meth:`on_token`, :meth:`on_done`,
    :meth:`on_error` from its thread (``prometheus-client``'s metrics are thread-safe), and
    :meth:`bind` gives the gauges their live sources. :meth:`render` -> (bytes, content type)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.running = Gauge("msllm:num_requests_running", "Rows decoding in the continuous batch.", registry=r)
        self.waiting = Gauge("msllm:num_requests_waiting", "Jobs waiting in the engine's queue.", registry=r)
        self.prompt_tokens = Counter("msllm:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("msllm:generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter("msllm:request_success", "Finished jobs.", ["finished_reason"], registry=r)
        self.failure = Counter("msllm:request_failure", "Jobs answered with an error.", registry=r)
        self.ttft = Histogram("msllm:time_to_first_token_seconds", "Time from queued to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("msllm:inter_token_latency_seconds", "Time between two tokens of one row.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("msllm:e2e_request_latency_seconds", "Time from queued to finished.",
                             buckets=E2E_BUCKETS, registry=r)
        self.kv_usage = Gauge("msllm:kv_cache_usage_perc", "Cache slots holding tokens / slots allocated (0..1).",
                              registry=r)
        self.kv_slots = Gauge("msllm:kv_cache_slots_in_use", "Cache slots holding a row's tokens.", registry=r)
        # vLLM v1's prefix cache counters count tokens (vllm/v1/metrics/loggers.py)
        self.prefix_queries = Counter("msllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("msllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self.prefix_blocks = Gauge("msllm:prefix_cache_blocks", "Blocks held by the prefix cache.", registry=r)
        self.prefix_bytes = Gauge("msllm:prefix_cache_bytes", "Bytes held by the prefix cache.", registry=r)

    def bind(self, engine) -> None:
        """Read the gauges from ``engine`` (its batch and queue) at each scrape."""
        self.running.set_function(lambda: engine.batch.active)
        self.waiting.set_function(lambda: engine.queue.qsize())
        self.kv_slots.set_function(lambda: kv_slots(engine.batch)[0])
        self.kv_usage.set_function(lambda: (lambda u, a: u / a if a else 0.0)(*kv_slots(engine.batch)))
        store = getattr(engine, "prefix_cache", None)
        self.prefix_blocks.set_function(lambda: len(store) if store is not None else 0)
        self.prefix_bytes.set_function(lambda: store.bytes if store is not None else 0)

    # ---- engine hooks (engine thread) ---------------------------------------------------------
    def on_admit(self, work) -> None:
        self.prompt_tokens.inc(len(work.job.prompt))

    def on_prefix(self, queried: int, hit: int) -> None:
        """A prompt of ``queried`` tokens looked up in the prefix cache, ``hit`` of them found."""
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)

    def on_token(self, work) -> None:
        now = time.monotonic()
        self.generation_tokens.inc()
        if work.t_last is None:
            self.ttft.observe(now - work.t_submit)
        else:
            self.itl.observe(now - work.t_last)
        work.t_last = now

    def on_done(self, work, reason: str) -> None:
        self.success.labels(finished_reason=reason).inc()
        self.e2e.observe(time.monotonic() - work.t_submit)

    def on_error(self, work) -> None:
        self.failure.inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def kv_slots(batch) -> tuple[int, int]:
    """(slots holding a row's tokens, slots allocated) of a :class:`~msllm.serving.batch.ContinuousBatch`;
    read from another thread, so from one snapshot of its row list."""
    rows, buffer = list(batch.rows), batch.buffer
    used = sum(r.slot + 1 - r.pad for r in rows if r is not None)
    return used, len(rows) * buffer


__all__ = ["ServerMetrics", "kv_slots"]
