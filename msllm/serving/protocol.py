"""OpenAI's HTTP API for text generation, as msllm serves it: validated fields -> jobs, responses.

Formats follow OpenAI's API reference and its Python client's types (``openai`` 3.x:
``types/completion.py``, ``completion_choice.py``, ``chat/chat_completion.py``,
``chat/chat_completion_chunk.py``, ``chat/chat_completion_token_logprob.py``, ``model.py``) and
what lm-evaluation-harness's ``local-completions`` backend sends and reads
(``lm_eval/models/openai_completions.py``). Every field is checked first by
:mod:`msllm.serving.validate` (types, ranges, limits); this module turns the checked fields into
:class:`Job` s and builds the answers:

* ``POST /v1/completions``: ``prompt`` as text, a list of texts, token ids or a list of id lists;
  text gets the tokenizer's BOS rule, ids are used as given (as vLLM); ``n`` choices per prompt
  (index ``i * n + j``). ``max_tokens`` (default 16, or the server's default), ``temperature``
  (default 1; 0, or below 1e-5 as in vLLM, = greedy), ``top_p``, ``top_k`` (extension; 0 or -1 =
  off), ``stop``, ``seed``,
  ``echo`` (the prompt's text, and with ``logprobs`` its tokens' log-probabilities, the first
  ``null``), ``logprobs`` (0..5), ``stream``, ``stream_options.include_usage``.
* ``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template (the one
  ``tools/chat.py`` uses); ``max_completion_tokens`` / ``max_tokens``, the sampling fields above,
  ``n``, ``logprobs`` / ``top_logprobs`` (OpenAI's ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs"}]}``); ``response_format`` on both (:mod:`msllm.serving.structured`).
* Responses: ``text_completion`` / ``chat.completion`` objects with ``usage``; streamed as
  ``chat.completion.chunk`` / ``text_completion`` chunks, ``data: {json}`` server-sent events
  ended by ``data: [DONE]``; ``finish_reason`` ``stop`` (an EOS id or a stop string) or ``length``.
* Errors: ``{"error": {"message", "type", "param", "code"}}`` with status 400, 401 (bearer key),
  404 (route, unknown model), 413 (body size), 429 (queue full), 500 (a failure while generating:
  a generic message, the traceback goes to the server's log), 503 (engine down, shutting down).

Log-probabilities are of the model's own distribution (log-softmax of the raw logits), before
temperature / top-k / top-p, as vLLM reports them by default; ``-inf`` is written as -9999.0.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

NEG_INF_LOGPROB = -9999.0   # JSON has no -inf (vLLM writes the same)


class ApiError(Exception):
    """An error answered as OpenAI's error object with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return ApiError(400, message, param, code)


def messages_error(exc: Exception) -> ApiError:
    """The 400 naming ``messages`` for a conversation that cannot be rendered (an MsllmError of
    ``msllm.generation.prompts`` or the chat template); a template's refusal is told without the
    path of the file it came from (``TemplateRefused.reason``: the server's layout is its own)."""
    return bad(getattr(exc, "reason", str(exc)), "messages")


@dataclass
class Job:
    """One prompt to continue (one choice of a response).

    prompt: token ids; max_tokens: new tokens at most (0: none, only ``echo``'s scoring);
    greedy / temperature / top_p / top_k / seed: the row's own sampling; stop: stop strings;
    logprobs: top alternatives per position (None: no log-probabilities); echo: return the prompt
    too; index: the choice's index in its response; grammar: the llguidance grammar of its
    ``response_format`` (:mod:`msllm.serving.structured`), None = free text.
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
    grammar: Optional[str] = None     # llguidance grammar the text must follow (response_format)


@dataclass
class Request:
    """A checked request: its jobs and how to answer (``chat``, ``stream``, ``include_usage``)."""

    jobs: list
    model: str
    chat: bool
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False          # chat: answer with OpenAI's chat logprobs object
    n: int = 1                      # choices per prompt (jobs i * n .. i * n + n - 1 share prompt i)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for a field it leaves out (``tools/serve.py`` builds it from the run YAML's
    ``generation_config`` and ``--max_tokens_default``: :func:`msllm.serving.defaults.request_defaults`).

    temperature / top_p / top_k: OpenAI's defaults (1.0, 1.0, off) unless the YAML sets them (its
    ``do_sample: false`` means temperature 0, greedy); max_tokens: None = OpenAI's 16 on
    completions and, on chat, the rest of the context window; either way at most the window.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: Optional[int] = None


# below this temperature a request is greedy, as in vLLM (sampling_params.py ``_SAMPLING_EPS``): dividing
# float32 logits by 1e-38 or less overflows them to inf, and sampling from that is noise
SAMPLING_EPS = 1e-5


def _sampling(f: dict, d: RequestDefaults) -> dict:
    """The validated sampling fields (``msllm.serving.validate``) -> :class:`Job` keyword arguments
    (a temperature below :data:`SAMPLING_EPS` is greedy)."""
    temperature = f.get("temperature", d.temperature)
    greedy = temperature < SAMPLING_EPS
    return dict(greedy=greedy, temperature=1.0 if greedy else float(temperature),
                top_p=float(f.get("top_p", d.top_p)), top_k=max(0, int(f.get("top_k", d.top_k))),
                seed=f.get("seed"), stop=f.get("stop", ()))


def _max_tokens(f: dict, keys: tuple, prompt_len: int, context: int, default: int) -> int:
    key = next((k for k in keys if k in f), None)
    value = f[key] if key else default
    where = "prompt" if keys[0] == "max_tokens" else "messages"
    if prompt_len >= context:
        raise bad(f"the prompt is {prompt_len} tokens long; this model's context window is {context} tokens",
                  where, "context_length_exceeded")
    if key is None:                       # a default never reaches past the window
        return min(value, context - prompt_len)
    if prompt_len + value > context:
        raise bad(f"'{key}' = {value} with a {prompt_len}-token prompt exceeds this model's context window of "
                  f"{context} tokens (at most {context - prompt_len})", key, "context_length_exceeded")
    return value


def _choices(prompts: list, n: int, kw: dict, **job) -> list:
    """``n`` jobs per prompt, choice index ``i * n + j`` (vLLM's order); with a seed, choice j samples
    with ``seed + j`` (as vLLM's parallel sampling seeds its child requests), so the n differ."""
    out = []
    for i, (p, m) in enumerate(prompts):
        for j in range(n):
            seed = None if kw["seed"] is None else kw["seed"] + j
            out.append(Job(p, m, index=i * n + j, **dict(kw, seed=seed), **job))
    return out


def completion_request(f: dict, tokenizer, context: int, defaults: RequestDefaults = RequestDefaults()) -> Request:
    """``POST /v1/completions``'s validated fields (:func:`msllm.serving.validate.check_request`) ->
    :class:`Request`: text prompts tokenized (the tokenizer's BOS rule), ids used as given.

    Raises:
        ApiError: 400 for a prompt that tokenizes to nothing or does not fit the context window.
    """
    kind, raw = f["prompt"]
    prompts = [tokenizer.encode_with_special(t) for t in raw] if kind == "text" else raw
    if any(not p for p in prompts):
        raise bad("'prompt' tokenizes to no tokens", "prompt")
    default = defaults.max_tokens if defaults.max_tokens is not None else 16    # OpenAI's default
    sized = [(p, _max_tokens(f, ("max_tokens",), len(p), context, default)) for p in prompts]
    stream = f.get("stream", False)
    jobs = _choices(sized, f.get("n", 1), _sampling(f, defaults), logprobs=f.get("logprobs"),
                    echo=f.get("echo", False))
    return Request(jobs, f["model"], chat=False, stream=stream,
                   include_usage=stream and f.get("stream_options", {}).get("include_usage", False),
                   n=f.get("n", 1))


def chat_request(f: dict, tokenizer, template, context: int, defaults: RequestDefaults = RequestDefaults()) -> Request:
    """``POST /v1/chat/completions``'s validated fields -> :class:`Request`: ``messages`` rendered
    with the chat template (the one ``tools/chat.py`` uses), ``n`` choices.

    Raises:
        ApiError: 400 for messages the template cannot render (naming why) or a prompt beyond the
            context window.
    """
    from msllm.errors import MsllmError
    from msllm.generation.prompts import _messages_record, encode_turns

    try:
        record = _messages_record(f["messages"], 0, "messages")
        if record.reference is not None:
            raise bad("the last message must be a user message (this server answers it)", "messages")
        ids = encode_turns(tokenizer, template, record.turns)
    except MsllmError as exc:
        raise messages_error(exc) from None
    default = defaults.max_tokens if defaults.max_tokens is not None else context
    m = _max_tokens(f, ("max_completion_tokens", "max_tokens"), len(ids), context, default)
    top = f.get("top_logprobs", 0) if f.get("logprobs") else None
    stream = f.get("stream", False)
    jobs = _choices([(ids, m)], f.get("n", 1), _sampling(f, defaults), logprobs=top)
    return Request(jobs, f["model"], chat=True, stream=stream,
                   include_usage=stream and f.get("stream_options", {}).get("include_usage", False),
                   logprobs=top is not None, n=f.get("n", 1))


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


def chat_logprobs(rows: list) -> dict:
    """Chat's ``logprobs`` object from (token text, log-probability, [(text, logprob) top]) per
    generated token (OpenAI's ``ChatCompletionTokenLogprob``: ``bytes`` = the text's UTF-8)."""
    def entry(t, lp):
        return {"token": t, "logprob": _lp(lp), "bytes": list(t.encode("utf-8"))}

    return {"content": [dict(entry(t, lp), top_logprobs=[entry(a, b) for a, b in top]) for t, lp, top in rows],
            "refusal": None}


def chat_response(req: Request, choices: list, prompt_tokens: int, completion_tokens: int) -> dict:
    """``choices``: (index, text, finish_reason, logprobs object or None) per choice."""
    return {"id": f"chatcmpl-{req.id}", "object": "chat.completion", "created": req.created, "model": req.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                         "finish_reason": finish} for i, text, finish, lp in choices],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(req: Request, index: int, text: str, finish: Optional[str], logprobs=None) -> dict:
    return {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created, "model": req.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunk(req: Request, delta: dict, finish: Optional[str], index: int = 0) -> dict:
    return {"id": f"chatcmpl-{req.id}", "object": "chat.completion.chunk", "created": req.created,
            "model": req.model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(req: Request, prompt_tokens: int, completion_tokens: int) -> dict:
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    return {"id": f"{'chatcmpl' if req.chat else 'cmpl'}-{req.id}", "object": kind, "created": req.created,
            "model": req.model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <json>`` and the blank line that ends it."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def result(work, prompt_rows: Optional[list], gen_rows: list, text: str) -> dict:
    """What the app needs to answer a finished job (``work``: the engine's ``Work``, its ``tokens``
    set): its text, token counts and log-probability rows."""
    return {"text": text, "completion_tokens": len(work.tokens), "prompt_tokens": len(work.job.prompt),
            "prompt_logprobs": prompt_rows, "logprobs": gen_rows}
