"""The Starlette application of ``tools/serve.py``: OpenAI's and vLLM's routes over an :class:`Engine`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI);
``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes: :mod:`msllm.serving.tokenize_routes`);
``GET /health`` (200 with the engine's counters while its thread runs, 503 once it has died);
``GET /metrics`` (Prometheus: :mod:`msllm.serving.metrics`). With an API key every ``/v1`` route
needs ``Authorization: Bearer KEY`` (401 otherwise), as vLLM guards only ``/v1``.

A request's body is read up to :attr:`Limits.max_body_bytes` (413 beyond, whatever
``Content-Length`` says), every field is checked (:mod:`msllm.serving.validate`), then prompts are
tokenized and chat templates rendered in Starlette's thread pool (``run_in_threadpool``), never on
the event loop that streams the other clients' tokens. A streamed response is
``text/event-stream``; when its client disconnects Starlette cancels the body generator and the
jobs are cancelled there (their rows stop at the engine's next step). A request answered whole
watches its connection while it waits (every :data:`DISCONNECT_POLL_S` seconds) and cancels its
jobs the same way when the client has gone. Formats and status codes:
:mod:`msllm.serving.protocol`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Optional

from msllm.serving.engine import Engine, QueueFull
from msllm.serving.protocol import (SSE_DONE, ApiError, Request, RequestDefaults, bad, chat_chunk, chat_logprobs,
                                    chat_request, chat_response, completion_chunk, completion_request,
                                    completion_response, logprobs_object, sse, usage_chunk)
from msllm.serving.validate import Limits, check_request, parse_body, too_large

log = logging.getLogger("msllm")
DISCONNECT_POLL_S = 0.25   # how often a non-streamed request checks that its client is still there


def build_app(engine: Engine, model_name: str, tokenizer, template, context: int, api_key: Optional[str] = None,
              limits: Limits = Limits(), defaults: RequestDefaults = RequestDefaults()):
    """The ASGI application. ``template``: the chat template (``msllm.generation.prompts.template_for``);
    ``context``: the model's window in tokens; ``limits``: what one request may ask
    (:class:`~msllm.serving.validate.Limits`); ``defaults``: values of fields a request leaves out."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from msllm.serving.tokenize_routes import detokenize_body, tokenize_body

    vocab = engine.config.vocab_size
    created = int(time.time())

    def error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    def check_key(request: HttpRequest) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), api_key.encode())):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    async def read_json(request: HttpRequest) -> dict:
        """The body, at most ``limits.max_body_bytes`` read (413 beyond), parsed and depth-checked."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise too_large(limits)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise too_large(limits)
            chunks.append(chunk)
        return await run_in_threadpool(parse_body, b"".join(chunks), limits)

    def submit_all(req: Request):
        """Queue every job of ``req``; returns (per-job asyncio queues, works)."""
        if not engine.alive():
            raise ApiError(503, "the engine is not running; see the server's log", code="engine_dead")
        cap = engine.queue.maxsize                    # 0: unbounded (queue.Queue's convention)
        if cap and len(req.jobs) > cap:               # a 429 it could never get past
            raise bad(f"this request asks for {len(req.jobs)} choices (prompts x n); this server queues at most "
                      f"{cap} (--max_queue)", "n")
        loop = asyncio.get_running_loop()
        queues, works = [], []
        try:
            for job in req.jobs:
                q: asyncio.Queue = asyncio.Queue()
                works.append(engine.submit(job, lambda ev, q=q: loop.call_soon_threadsafe(q.put_nowait, ev)))
                queues.append(q)
        except QueueFull:
            for w in works:
                w.cancel()
            raise ApiError(429, "the server's queue is full; retry later", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        return queues, works

    async def models(request: HttpRequest):
        try:
            check_key(request)
        except ApiError as exc:
            return error(exc)
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                                         "owned_by": "msllm"}]})

    async def health(request: HttpRequest):
        alive = engine.alive()
        return JSONResponse({"status": "ok" if alive else "engine thread not running", **engine.stats()},
                            status_code=200 if alive else 503)

    async def metrics(request: HttpRequest):
        data, kind = engine.metrics.render()
        return Response(data, media_type=kind)

    def build(body: dict, chat: bool) -> Request:
        """Runs in the thread pool: every field checked, then tokenized / rendered."""
        f = check_request(body, chat, model_name, limits, vocab)
        req = (chat_request(f, tokenizer, template, context, defaults) if chat
               else completion_request(f, tokenizer, context, defaults))
        scored = max((len(j.prompt) for j in req.jobs if j.echo and j.logprobs is not None), default=0)
        if scored > limits.max_echo_logprobs_tokens:
            raise bad(f"'echo' with 'logprobs' scores the prompt in one pass that pauses every other request: at "
                      f"most {limits.max_echo_logprobs_tokens} prompt tokens (--max_echo_logprobs_tokens), got "
                      f"{scored}", "echo")
        if f.get("response_format") is not None:      # a JSON schema: every choice follows its grammar
            grammar = engine.structured.grammar(f["response_format"])
            for job in req.jobs:
                job.grammar = grammar
        return req

    async def handle(request: HttpRequest, chat: bool):
        try:
            check_key(request)
            body = await read_json(request)
            req = await run_in_threadpool(build, body, chat)
            queues, works = submit_all(req)
        except ApiError as exc:
            return error(exc)
        if req.stream:
            return StreamingResponse(stream(req, queues, works), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collecting = asyncio.ensure_future(collect_all(queues))
        watching = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            gone = watching.done() and not watching.cancelled() and watching.exception() is None
            if not collecting.done() and gone:     # the client went away: its rows stop at the next step
                log.info("serving: a client left before its answer; its %d choice(s) cancelled", len(works))
                return Response(status_code=499)      # nginx's "client closed request": nobody reads it
            if not collecting.done():              # the watcher itself failed: wait for the answer
                log.warning("serving: watching a connection failed (%r); waiting for the answer",
                            watching.exception())
                await collecting
            results = collecting.result()
        except ApiError as exc:
            return error(exc)
        finally:                 # both tasks end with this request, however it ends (a cancel included)
            for task in (collecting, watching):
                task.cancel()
            for w in works:      # the client may be gone: nothing left to compute either way
                w.cancel()
        # a prompt counts once however many choices it has (OpenAI's usage)
        prompt_tokens = sum(r["prompt_tokens"] for j, r in zip(req.jobs, results) if j.index % req.n == 0)
        completion_tokens = sum(r["completion_tokens"] for r in results)
        if chat:
            choices = [(j.index, r["text"], finish_of(r), chat_lp(r) if req.logprobs else None)
                       for j, r in zip(req.jobs, results)]
            return JSONResponse(chat_response(req, choices, prompt_tokens, completion_tokens))
        choices = [completion_choice(req.jobs[i], r) for i, r in enumerate(results)]
        return JSONResponse(completion_response(req, choices, prompt_tokens, completion_tokens))

    def finish_of(r: dict) -> str:
        return "length" if r["finish"] == "cancelled" else r["finish"]

    def chat_lp(r: dict) -> dict:
        def text(t):
            return tokenizer.decode([t])
        return chat_logprobs([(text(row[3]), row[1], [(text(a), b) for a, b in row[4]]) for row in r["logprobs"]])

    async def collect_all(queues: list) -> list:
        return [await collect(q) for q in queues]

    async def until_disconnected(request: HttpRequest) -> None:
        """Returns once the client has closed its connection (polled: Starlette's receive says so
        only when asked)."""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def collect(q: asyncio.Queue) -> dict:
        text = []
        while True:
            kind, a, b = _unpack(await q.get())
            if kind == "text":
                text.append(a)
            elif kind == "error":
                raise a
            else:
                return dict(b, finish=a)

    def completion_choice(job, r: dict) -> dict:
        text = r["text"]
        lp = None
        if job.echo:
            text = tokenizer.decode(job.prompt) + text
        if job.logprobs is not None:
            rows = (r["prompt_logprobs"] or []) + r["logprobs"]
            lp = logprobs_object([x[0] for x in rows], [x[1] for x in rows], [x[2] for x in rows])
        return {"index": job.index, "text": text, "logprobs": lp, "finish_reason": finish_of(r)}

    async def stream(req: Request, queues: list, works: list):
        prompt_tokens = completion_tokens = 0
        n = req.n
        try:
            if req.chat:
                for j in req.jobs:
                    yield sse(chat_chunk(req, {"role": "assistant", "content": ""}, None, j.index))
            pending = {i: q for i, q in enumerate(queues)}
            while pending:
                # one job at a time in index order keeps the events of a choice in order; the
                # other jobs' events wait in their queues meanwhile (they still decode)
                i = min(pending)
                index = req.jobs[i].index
                kind, a, b = _unpack(await pending[i].get())
                if kind == "text":
                    yield sse(chat_chunk(req, {"content": a}, None, index) if req.chat else
                              completion_chunk(req, index, a, None))
                elif kind == "error":               # this choice failed: its index says which
                    yield sse(dict(a.body(), index=index))
                    del pending[i]
                else:
                    finish = "length" if a == "cancelled" else a
                    prompt_tokens += b["prompt_tokens"] if index % n == 0 else 0
                    completion_tokens += b["completion_tokens"]
                    yield sse(chat_chunk(req, {}, finish, index) if req.chat else
                              completion_chunk(req, index, "", finish))
                    del pending[i]
            if req.include_usage:
                yield sse(usage_chunk(req, prompt_tokens, completion_tokens))
            yield SSE_DONE
        finally:   # normal end, or the client went away (Starlette cancels this generator)
            for w in works:
                w.cancel()

    async def completions(request):
        return await handle(request, chat=False)

    async def chat_completions(request):
        return await handle(request, chat=True)

    async def tokenize(request: HttpRequest):
        try:
            body = await read_json(request)
            out = await run_in_threadpool(tokenize_body, body, model_name, tokenizer, template, context, limits)
        except ApiError as exc:
            return error(exc)
        return JSONResponse(out)

    async def detokenize(request: HttpRequest):
        try:
            body = await read_json(request)
            out = await run_in_threadpool(detokenize_body, body, model_name, tokenizer, vocab)
        except ApiError as exc:
            return error(exc)
        return JSONResponse(out)

    async def not_found(request, exc):
        return error(ApiError(404, f"no route {request.method} {request.url.path}"))

    async def server_error(request, exc):
        log.exception("serving: unexpected error")
        return error(ApiError(500, "internal server error; the error is in the server's log"))

    routes = [Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found, 500: server_error})


def _unpack(event) -> tuple:
    """An engine event as (kind, a, b)."""
    return tuple(event) + (None,) * (3 - len(event))


__all__ = ["build_app"]
