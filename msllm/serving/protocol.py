"""OpenAI's HTTP API for text generation, as msllm serves it: request checking, jobs, responses.

Formats follow OpenAI's API reference and its Python client's types (``openai`` 3.x:
``types/completion.py``, ``completion_choice.py``, ``chat/chat_completion.py``,
``chat/chat_completion_chunk.py``, ``model.py``) and what lm-evaluation-harness's
``local-completions`` backend sends and reads (``lm_eval/models/openai_completions.py``):

* ``POST /v1/completions``: ``prompt`` as text, a list of texts, token ids or a list of id lists
  (one choice per prompt); text gets the tokenizer's BOS rule, ids are used as given (as vLLM).
  ``max_tokens`` (default 16), ``temperature`` (default 1; 0 = greedy), ``top_p``, ``top_k``
  (extension; 0 or -1 = off), ``stop`` (a string or up to 4), ``seed``, ``echo`` (the prompt's
  text, and with ``logprobs`` its tokens' log-probabilities, the first ``null``), ``logprobs``
  (0..5: the sampled token's log-probability and the top ``logprobs`` alternatives per position),
  ``stream``, ``stream_options.include_usage``.
* ``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template (the one
  ``tools/chat.py`` uses); ``max_tokens`` / ``max_completion_tokens``, the sampling fields above.
* Responses: ``text_completion`` / ``chat.completion`` objects with ``usage``; streamed as
  ``chat.completion.chunk`` / ``text_completion`` chunks, ``data: {json}`` server-sent events
  ended by ``data: [DONE]``; ``finish_reason`` ``stop`` (an EOS id or a stop string) or ``length``.
* Errors: ``{"error": {"message", "type", "param", "code"}}`` with status 400 (a field that is
  malformed, out of range, or asks for what msllm does not do, e.g. ``n`` > 1, ``tools``), 401
  (bearer key), 404 (route), 429 (queue full), 500.

Log-probabilities are of the model's own distribution (log-softmax of the raw logits), before
temperature / top-k / top-p, as vLLM reports them by default; ``-inf`` is written as -9999.0.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

MAX_LOGPROBS = 5            # OpenAI's limit for completions' logprobs
MAX_STOPS = 4
NEG_INF_LOGPROB = -9999.0   # JSON has no -inf (vLLM writes the same)
# fields msllm refuses unless they are off (field -> value that means "off")
UNSUPPORTED = {"n": 1, "best_of": 1, "suffix": None, "logit_bias": None, "tools": None, "tool_choice": None,
               "functions": None, "function_call": None, "response_format": None, "presence_penalty": 0,
               "frequency_penalty": 0, "top_logprobs": None, "audio": None,
               "modalities": None, "prediction": None, "parallel_tool_calls": None}


class ApiError(Exception):
    """An error answered as OpenAI's error object with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class Job:
    """One prompt to continue (one choice of a response).

    prompt: token ids; max_tokens: new tokens at most (0: none, only ``echo``'s scoring);
    greedy / temperature / top_p / top_k / seed: the row's own sampling; stop: stop strings;
    logprobs: top alternatives per position (None: no log-probabilities); echo: return the prompt
    too; index: the choice's index in its response.
    """

    prompt: list
    max_tokens: int
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: tuple = ()
    logprobs: Optional[int] = None
    echo: bool = False
    index: int = 0


@dataclass
class Request:
    """A checked request: its jobs and how to answer (``chat``, ``stream``, ``include_usage``)."""

    jobs: list
    model: str
    chat: bool
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object; ApiError 400 otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _number(body: dict, key: str, default, lo=None, hi=None, integer: bool = False):
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        raise bad(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        want = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise bad(f"'{key}' must be {want}, got {value}", key)
    return value


def _check_unsupported(body: dict) -> None:
    for key, off in UNSUPPORTED.items():
        if key in body and body[key] is not None and body[key] != off and not (key == "n" and body[key] == 1):
            raise bad(f"'{key}' is not supported by this server (msllm serves one choice per prompt, "
                      "text only, no tools or penalties)", key, "unsupported_parameter")


def _stops(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in stops if s)


def sampling(body: dict) -> dict:
    """The sampling fields shared by both endpoints -> :class:`Job` keyword arguments."""
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = _number(body, "top_k", 0, -1, None, integer=True)
    seed = _number(body, "seed", None, integer=True)
    if top_p == 0.0:
        raise bad("'top_p' must be > 0", "top_p")
    return dict(greedy=temperature == 0.0, temperature=float(temperature) or 1.0, top_p=float(top_p),
                top_k=max(0, int(top_k)), seed=seed, stop=_stops(body))


def _model(body: dict, served: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required (GET /v1/models lists it)", "model")
    if model != served:
        raise bad(f"the model {model!r} does not exist; this server serves {served!r}", "model", "model_not_found")
    return model


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return stream, bool(opts.get("include_usage", False)) and stream


def _max_tokens(body: dict, prompt_len: int, context: int, keys=("max_tokens",), default: int = 16) -> int:
    key = next((k for k in keys if body.get(k) is not None), keys[0])
    value = _number(body, key, default, 0, None, integer=True)
    if prompt_len >= context:
        raise bad(f"the prompt is {prompt_len} tokens long; this model's context window is {context} tokens",
                  "prompt" if keys[0] == "max_tokens" else "messages", "context_length_exceeded")
    if prompt_len + value > context:
        raise bad(f"'{key}' = {value} with a {prompt_len}-token prompt exceeds this model's context window of "
                  f"{context} tokens (at most {context - prompt_len})", key, "context_length_exceeded")
    return value


def _prompts(prompt, tokenizer, vocab_size: int) -> list:
    """``prompt`` in any of its four forms -> list of token-id lists."""
    def ids_ok(p):
        return isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    elif ids_ok(prompt):
        texts, prompt = None, [prompt]
    elif isinstance(prompt, list) and prompt and all(ids_ok(p) for p in prompt):
        texts = None
    else:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists "
                  "(none empty)", "prompt")
    if texts is not None:
        return [tokenizer.encode_with_special(t) for t in texts]
    for p in prompt:
        if min(p) < 0 or max(p) >= vocab_size:
            raise bad(f"'prompt' holds token ids outside [0, {vocab_size})", "prompt")
    return [list(p) for p in prompt]


def completion_request(body: dict, served: str, tokenizer, vocab_size: int, context: int) -> Request:
    """``POST /v1/completions`` -> :class:`Request` (ApiError 400 for anything malformed)."""
    _check_unsupported(body)
    model = _model(body, served)
    stream, usage = _stream(body)
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt")
    prompts = _prompts(body["prompt"], tokenizer, vocab_size)
    lp = body.get("logprobs")
    if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
        raise bad(f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad("'echo' must be true or false", "echo")
    if echo and stream:
        raise bad("'echo' with 'stream' is not supported", "echo", "unsupported_parameter")
    kw = sampling(body)
    jobs = [Job(p, _max_tokens(body, len(p), context), logprobs=lp, echo=echo, index=i, **kw)
            for i, p in enumerate(prompts)]
    return Request(jobs, model, chat=False, stream=stream, include_usage=usage)


def _content(message: dict, t: int) -> str:
    content = message.get("content")
    if isinstance(content, list):   # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"message {t}: only text content parts are supported", "messages")
        return "".join(p["text"] for p in content)
    return content


def chat_request(body: dict, served: str, tokenizer, template, context: int) -> Request:
    """``POST /v1/chat/completions`` -> :class:`Request`: ``messages`` through the chat template."""
    from msllm.errors import MsllmError
    from msllm.generation.prompts import _messages_record, encode_turns

    _check_unsupported(body)
    if body.get("logprobs"):
        raise bad("'logprobs' is not supported on chat completions (use /v1/completions)", "logprobs",
                  "unsupported_parameter")
    model = _model(body, served)
    stream, usage = _stream(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    flat = [dict(m, content=_content(m, t)) if isinstance(m, dict) else m for t, m in enumerate(messages)]
    try:
        record = _messages_record(flat, 0, "messages")
        if record.reference is not None:
            raise bad("the last message must be a user message (this server answers it)", "messages")
        ids = encode_turns(tokenizer, template, record.turns)
    except MsllmError as exc:
        raise bad(str(exc), "messages") from None
    kw = sampling(body)
    job = Job(ids, _max_tokens(body, len(ids), context, ("max_completion_tokens", "max_tokens"),
                               default=context - len(ids)), **kw)
    return Request([job], model, chat=True, stream=stream, include_usage=usage)


# ---- responses ---------------------------------------------------------------------------------

def _lp(x: float) -> float:
    return NEG_INF_LOGPROB if x == float("-inf") else float(x)


def logprobs_object(tokens: list, logprobs: list, tops: list, text_start: int = 0) -> dict:
    """Completions' ``logprobs``: token strings, their log-probabilities (None for the first prompt
    token), the top alternatives per position ({token: logprob} or None), and each token's
    character offset in the choice's text."""
    offsets, pos = [], text_start
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [None if x is None else _lp(x) for x in logprobs],
            "top_logprobs": [None if d is None else {k: _lp(v) for k, v in d.items()} for d in tops],
            "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(req: Request, choices: list, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created, "model": req.model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chat_response(req: Request, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": f"chatcmpl-{req.id}", "object": "chat.completion", "created": req.created, "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(req: Request, index: int, text: str, finish: Optional[str], logprobs=None) -> dict:
    return {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created, "model": req.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunk(req: Request, delta: dict, finish: Optional[str]) -> dict:
    return {"id": f"chatcmpl-{req.id}", "object": "chat.completion.chunk", "created": req.created,
            "model": req.model, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(req: Request, prompt_tokens: int, completion_tokens: int) -> dict:
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    return {"id": f"{'chatcmpl' if req.chat else 'cmpl'}-{req.id}", "object": kind, "created": req.created,
            "model": req.model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <json>`` and the blank line that ends it."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
