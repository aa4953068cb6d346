"""The Starlette application of ``tools/serve.py``: OpenAI's routes over an :class:`Engine`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health``. With an API key every ``/v1`` route needs ``Authorization: Bearer KEY`` (401
otherwise). A streamed response is ``text/event-stream``; when its client disconnects Starlette
cancels the body generator and the job is cancelled there (its row stops at the engine's next
step). Formats and status codes: :mod:`msllm.serving.protocol`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Optional

from msllm.serving.engine import Engine, QueueFull
from msllm.serving.protocol import (SSE_DONE, ApiError, Request, chat_chunk, chat_request, chat_response,
                                    completion_chunk, completion_request, completion_response, logprobs_object,
                                    parse_json, sse, usage_chunk)

log = logging.getLogger("msllm")


def build_app(engine: Engine, model_name: str, tokenizer, template, context: int, api_key: Optional[str] = None):
    """The ASGI application. ``template``: the chat template (``msllm.generation.prompts.template_for``)."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

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

    def submit_all(req: Request):
        """Queue every job of ``req``; returns (per-job asyncio queues, works)."""
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
        return JSONResponse({"status": "ok", **engine.stats()})

    async def handle(request: HttpRequest, chat: bool):
        try:
            check_key(request)
            body = parse_json(await request.body())
            req = (chat_request(body, model_name, tokenizer, template, context) if chat
                   else completion_request(body, model_name, tokenizer, vocab, context))
            queues, works = submit_all(req)
        except ApiError as exc:
            return error(exc)
        if req.stream:
            return StreamingResponse(stream(req, queues, works), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            results = [await collect(q) for q in queues]
        except ApiError as exc:
            return error(exc)
        finally:
            for w in works:      # the client may be gone: nothing left to compute either way
                w.cancel()
        prompt_tokens = sum(r["prompt_tokens"] for r in results)
        completion_tokens = sum(r["completion_tokens"] for r in results)
        if chat:
            r = results[0]
            return JSONResponse(chat_response(req, r["text"], r["finish"], prompt_tokens, completion_tokens))
        choices = [completion_choice(req.jobs[i], r) for i, r in enumerate(results)]
        return JSONResponse(completion_response(req, choices, prompt_tokens, completion_tokens))

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
            prompt_text = tokenizer.decode(job.prompt)
            text = prompt_text + text
        if job.logprobs is not None:
            rows = (r["prompt_logprobs"] or []) + r["logprobs"]
            lp = logprobs_object([x[0] for x in rows], [x[1] for x in rows], [x[2] for x in rows])
        return {"index": job.index, "text": text, "logprobs": lp,
                "finish_reason": "length" if r["finish"] == "cancelled" else r["finish"]}

    async def stream(req: Request, queues: list, works: list):
        prompt_tokens = completion_tokens = 0
        try:
            if req.chat:
                yield sse(chat_chunk(req, {"role": "assistant", "content": ""}, None))
            pending = {i: q for i, q in enumerate(queues)}
            while pending:
                # one job at a time in index order keeps the events of a choice in order; every job
                # of a request runs in the same batch, so waiting on the first does not stall the rest
                i = min(pending)
                kind, a, b = _unpack(await pending[i].get())
                if kind == "text":
                    yield sse(chat_chunk(req, {"content": a}, None) if req.chat else
                              completion_chunk(req, req.jobs[i].index, a, None))
                elif kind == "error":
                    yield sse(a.body())
                    del pending[i]
                else:
                    finish = "length" if a == "cancelled" else a
                    prompt_tokens += b["prompt_tokens"]
                    completion_tokens += b["completion_tokens"]
                    yield sse(chat_chunk(req, {}, finish) if req.chat else
                              completion_chunk(req, req.jobs[i].index, "", finish))
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

    async def not_found(request, exc):
        return error(ApiError(404, f"no route {request.method} {request.url.path}"))

    async def server_error(request, exc):
        log.exception("serving: unexpected error")
        return error(ApiError(500, f"internal error: {type(exc).__name__}"))

    routes = [Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found, 500: server_error})


def _unpack(event) -> tuple:
    """An engine event as (kind, a, b)."""
    return tuple(event) + (None,) * (3 - len(event))


__all__ = ["build_app"]
