"""Every field of a request body checked before anything is tokenized or queued for the engine.

One table per endpoint (:data:`COMPLETION_FIELDS`, :data:`CHAT_FIELDS`) maps each field msllm reads
to its checker; :func:`check_request` runs all of them and returns the normalised values, or raises
one :class:`~msllm.serving.protocol.ApiError` naming the field and what was expected, with OpenAI's
status codes (OpenAI API reference, "Error codes"): 400 for a malformed or out-of-range field, 404
for a model this server does not serve (``code: model_not_found``), 413 for a body over
:attr:`Limits.max_body_bytes`. Fields outside the tables are ignored (lm-evaluation-harness sends
its task's generation keys), except those in :data:`UNSUPPORTED`, refused unless they are "off".

Ranges follow OpenAI's reference where it states one (``temperature`` [0, 2], ``top_p`` (0, 1],
``logprobs`` 0..5 on completions, ``top_logprobs`` 0..20 on chat, ``stop`` at most 4) and vLLM's
``entrypoints/openai/protocol.py`` for its extensions (``top_k`` -1 or >= 0, ``seed`` at most
2**63 - 1). vLLM accepts negative seeds (torch does); msllm's sampler is numpy's ``default_rng``,
whose ``SeedSequence`` raises ``ValueError: expected non-negative integer`` for them, so the seed
range here is [0, 2**63 - 1]. JSON's non-standard ``NaN`` / ``Infinity`` (which Python's ``json``
accepts by default) and numbers that overflow to infinity are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from msllm.serving.protocol import ApiError, bad
from msllm.serving.structured import check_response_format

SEED_MAX = 2 ** 63 - 1
MAX_COMPLETION_LOGPROBS = 5     # OpenAI: completions' logprobs <= 5
MAX_TOP_LOGPROBS = 20           # OpenAI: chat's top_logprobs in [0, 20]
# fields msllm refuses unless they are off (field -> value that means "off"): OpenAI's that this server
# does not serve, and vLLM's extensions (entrypoints/openai/protocol.py) that would change the output
UNSUPPORTED = {"suffix": None, "logit_bias": None, "tools": None, "tool_choice": None, "functions": None,
               "function_call": None, "presence_penalty": 0, "frequency_penalty": 0,
               "audio": None, "modalities": None, "prediction": None, "parallel_tool_calls": None,
               "repetition_penalty": 1, "min_p": 0, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": [],
               "use_beam_search": False, "length_penalty": 1, "include_stop_str_in_output": False,
               "skip_special_tokens": True, "prompt_logprobs": None, "truncate_prompt_tokens": None,
               "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
               "structured_outputs": None, "bad_words": [], "allowed_token_ids": None}
# and on chat only: vLLM's chat-rendering extensions (msllm renders with the server's template, as is)
CHAT_UNSUPPORTED = {"echo": False, "continue_final_message": False, "add_generation_prompt": True,
                    "chat_template": None, "chat_template_kwargs": None}
_CHAT_REFUSED = dict(UNSUPPORTED, **CHAT_UNSUPPORTED)


def is_off(value, off) -> bool:
    """True when a request's ``value`` of an :data:`UNSUPPORTED` field means what ``off`` means, of
    the same JSON type (``false`` is not the number 0, ``0`` is not ``false``)."""
    if off is None or isinstance(off, bool):
        return value is off
    if isinstance(off, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == off
    return isinstance(value, type(off)) and value == off


@dataclass(frozen=True)
class Limits:
    """What one request may ask for at most (``tools/serve.py`` flags set some of them).

    max_body_bytes: the request body's size (413 above it); max_json_depth: nesting of arrays and
    objects in it; max_prompts: choices in one request (prompts x ``n``); max_n: ``n``;
    max_stops / max_stop_chars: stop strings and each one's length in characters;
    max_messages: chat messages; max_echo_logprobs_tokens: the prompt tokens ``echo`` with
    ``logprobs`` scores (one forward pass over the whole prompt on the engine thread, which pauses
    every other row's decoding meanwhile, and a (prompt, vocabulary) float32 logits array).
    """

    max_body_bytes: int = 4 << 20
    max_json_depth: int = 32
    max_prompts: int = 64
    max_n: int = 8
    max_stops: int = 4
    max_stop_chars: int = 256
    max_messages: int = 512
    max_echo_logprobs_tokens: int = 2048


# ---- the body ---------------------------------------------------------------------------------

def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _is_bad(v) -> bool:
    """A string that is not valid Unicode (a lone surrogate) or a float that overflowed to infinity."""
    if isinstance(v, str):
        if v.isascii():
            return False
        try:
            v.encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True
    return isinstance(v, float) and not math.isfinite(v)


def scan(value: Any) -> tuple:
    """(nesting depth of arrays / objects (a scalar: 0), whether any key or value is bad
    (:func:`_is_bad`)) of a parsed JSON value, in one iterative walk; a list of plain integers (token
    ids, the bulk of a large body) is passed over without a look at each."""
    deepest, bad_seen, todo = 0, False, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            bad_seen = bad_seen or any(_is_bad(k) for k in v)
            todo.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            if not all(type(c) is int for c in v):
                todo.extend((c, d + 1) for c in v)
        elif not bad_seen:
            bad_seen = _is_bad(v)
    return deepest, bad_seen


def json_depth(value: Any) -> int:
    """Nesting depth of arrays / objects in a parsed JSON value (a scalar: 0), iteratively."""
    return scan(value)[0]


def _printable(key: str) -> str:
    """A key as it can be written back in an error message (a lone surrogate as its escape)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _name_the_bad_value(body: dict) -> ApiError:
    """The 400 naming where :func:`scan` found a bad key or value: its path (``messages[0].content``)
    and its top-level field (``param``; None when that field's own name is the bad string)."""
    todo = [(body, None, "")]
    while todo:
        v, top, path = todo.pop()
        if isinstance(v, dict):
            for k, c in v.items():
                here = f"{path}.{_printable(k)}" if path else _printable(k)
                if _is_bad(k):
                    return bad(f"the key '{here}' is not valid Unicode: it holds a lone surrogate", top)
                todo.append((c, top or k, here))
        elif isinstance(v, list):
            todo.extend((c, top, f"{path}[{i}]") for i, c in enumerate(v))
        elif isinstance(v, str) and _is_bad(v):
            i = next(i for i, ch in enumerate(v) if 0xD800 <= ord(ch) <= 0xDFFF)
            return bad(f"'{path}' is not valid Unicode: it holds a lone surrogate (U+{ord(v[i]):04X})", top)
        elif _is_bad(v):
            return bad(f"'{path}' must be a finite number (it overflows float64)", top)
    raise AssertionError("scan() found a bad value that this walk did not")


def parse_body(raw: bytes, limits: Limits) -> dict:
    """The request body -> a JSON object.

    Raises:
        ApiError: 413 over ``limits.max_body_bytes``; 400 for invalid JSON (NaN / Infinity
            included), nesting deeper than ``limits.max_json_depth``, anything but an object, or a
            key or value anywhere in it, read or not, that is a string with a lone surrogate (JSON's
            ``\\uD800``-style escapes encode one, which Python's ``json`` accepts but no tokenizer,
            template or UTF-8 writer does) or a number that overflowed to infinity (``1e309``), naming
            its path.
    """
    if len(raw) > limits.max_body_bytes:
        raise too_large(limits)
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:   # Python's parser recurses per level: thousands of '[' end here
        raise bad(f"the request body nests deeper than {limits.max_json_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    depth, has_bad = scan(body)
    if depth > limits.max_json_depth:
        raise bad(f"the request body nests deeper than {limits.max_json_depth} levels")
    if has_bad:
        raise _name_the_bad_value(body)
    return body


def too_large(limits: Limits) -> ApiError:
    return ApiError(413, f"the request body is larger than {limits.max_body_bytes} bytes",
                    code="request_too_large", kind="invalid_request_error")


# ---- checkers: (key, value, limits) -> normalised value ------------------------------------

def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(lo=None, hi=None, integer=False, lo_open=False) -> Callable:
    def check(key, v, limits):
        ok = is_int(v) if integer else (isinstance(v, (int, float)) and not isinstance(v, bool))
        if not ok:
            raise bad(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
        if not integer and not math.isfinite(v):
            raise bad(f"'{key}' must be a finite number, got {v!r}", key)
        below = lo is not None and (v <= lo if lo_open else v < lo)
        if below or (hi is not None and v > hi):
            left = "(" if lo_open else "["
            want = (f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in {left}{lo}, {hi}]")
            raise bad(f"'{key}' must be {want}, got {v}", key)
        return v
    return check


def check_bool(key, v, limits):
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false, got {v!r}", key)
    return v


def _string(key, v, limits):
    if not isinstance(v, str):
        raise bad(f"'{key}' must be a string, got {type(v).__name__}", key)
    return v


def _n(key, v, limits):
    return _number(1, limits.max_n, integer=True)(key, v, limits)


def _stop(key, v, limits) -> tuple:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad(f"'stop' must be a string or a list of strings, got {type(v).__name__}", key)
    if len(stops) > limits.max_stops:
        raise bad(f"'stop' holds {len(stops)} strings; at most {limits.max_stops}", key)
    long = [s for s in stops if len(s) > limits.max_stop_chars]
    if long:
        raise bad(f"'stop' strings must be at most {limits.max_stop_chars} characters, got one of {len(long[0])}",
                  key)
    return tuple(s for s in stops if s)


def _stream_options(key, v, limits) -> dict:
    if not isinstance(v, dict):
        raise bad("'stream_options' must be an object", key)
    if "include_usage" in v and not isinstance(v["include_usage"], bool):
        raise bad("'stream_options.include_usage' must be true or false", key)
    return v


def _prompt(key, v, limits) -> tuple:
    """-> ("text", [str, ...]) or ("ids", [[int, ...], ...]); every prompt non-empty."""
    def ids(p):
        return isinstance(p, list) and len(p) > 0 and all(is_int(t) for t in p)

    if isinstance(v, str):
        kind, prompts = "text", [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        kind, prompts = "text", v
    elif ids(v):
        kind, prompts = "ids", [v]
    elif isinstance(v, list) and v and all(ids(p) for p in v):
        kind, prompts = "ids", v
    else:
        raise bad("'prompt' must be a non-empty string, a list of them, a non-empty list of token ids or a list "
                  "of such lists", key)
    if kind == "text" and not all(prompts):
        raise bad("'prompt' must not be empty", key)
    if len(prompts) > limits.max_prompts:
        raise bad(f"'prompt' holds {len(prompts)} prompts; at most {limits.max_prompts} per request", key)
    return kind, [list(p) for p in prompts] if kind == "ids" else list(prompts)


def check_messages(key, v, limits) -> list:
    if not isinstance(v, list) or not v:
        raise bad("'messages' must be a non-empty list", key)
    if len(v) > limits.max_messages:
        raise bad(f"'messages' holds {len(v)} messages; at most {limits.max_messages}", key)
    out = []
    for t, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{t}] must be an object with a string 'role'", key)
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{t}]: only text content parts are supported", key)
            content = "\n".join(p["text"] for p in content)   # as vLLM (entrypoints/chat_utils.py) joins them
        elif not isinstance(content, str):
            raise bad(f"messages[{t}].content must be a string or a list of text parts", key)
        out.append(dict(m, content=content))
    return out


COMMON_FIELDS = {
    "model": _string, "stream": check_bool, "stream_options": _stream_options, "n": _n,
    "max_tokens": _number(0, None, integer=True), "temperature": _number(0.0, 2.0),
    "top_p": _number(0.0, 1.0, lo_open=True), "top_k": _number(-1, None, integer=True),
    "seed": _number(0, SEED_MAX, integer=True), "stop": _stop, "user": _string,
    "response_format": check_response_format,   # shape only; the grammar: msllm/serving/structured.py
}
COMPLETION_FIELDS = dict(COMMON_FIELDS, prompt=_prompt, echo=check_bool, best_of=_n,
                         logprobs=_number(0, MAX_COMPLETION_LOGPROBS, integer=True))
CHAT_FIELDS = dict(COMMON_FIELDS, messages=check_messages, logprobs=check_bool,
                   max_completion_tokens=_number(1, None, integer=True),
                   max_tokens=_number(1, None, integer=True),
                   top_logprobs=_number(0, MAX_TOP_LOGPROBS, integer=True))
REQUIRED = {"completion": ("model", "prompt"), "chat": ("model", "messages")}


def check_model(model, served: str) -> str:
    """A request's ``model``: 400 unless a string, 404 (``model_not_found``, as OpenAI answers) unless
    the one this server serves."""
    _string("model", model, None)
    if model != served:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served}'",
                       "model", "model_not_found", kind="invalid_request_error")
    return model


def check_request(body: dict, chat: bool, served: str, limits: Limits, vocab_size: int) -> dict:
    """Every field of a ``/v1/completions`` (``chat`` False) or ``/v1/chat/completions`` body ->
    {field: normalised value} for the fields present and not null.

    Raises:
        ApiError: 400 naming the field (missing, wrong type, out of range, token id outside
            [0, ``vocab_size``), unsupported, or a combination msllm does not serve), 404 for an
            unknown model.
    """
    table = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key in REQUIRED["chat" if chat else "completion"]:
        if body.get(key) is None:
            raise bad(f"'{key}' is required", key)
    for key, off in (_CHAT_REFUSED if chat else UNSUPPORTED).items():
        if key in body and body[key] is not None and not is_off(body[key], off):
            send = "" if off is None else f" or send {json.dumps(off)}"
            raise bad(f"'{key}' is not supported by this server (leave it out{send})", key, "unsupported_parameter")
    out = {key: table[key](key, v, limits) for key, v in body.items() if key in table and v is not None}
    check_model(out["model"], served)
    n = out.get("n", 1)
    if "best_of" in out and out["best_of"] != n:
        raise bad("'best_of' other than 'n' is not supported", "best_of", "unsupported_parameter")
    if out.get("stream") and (out.get("logprobs") is not None and out.get("logprobs") is not False):
        raise bad("'logprobs' with 'stream' is not supported (ask without streaming)", "logprobs",
                  "unsupported_parameter")
    if out.get("echo") and out.get("stream"):
        raise bad("'echo' with 'stream' is not supported", "echo", "unsupported_parameter")
    if "top_logprobs" in out and not out.get("logprobs"):
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if not chat:
        kind, prompts = out["prompt"]
        if len(prompts) * n > limits.max_prompts:
            raise bad(f"{len(prompts)} prompts x n={n} choices; at most {limits.max_prompts} per request", "n")
        if kind == "ids":
            worst = next((t for p in prompts for t in p if not 0 <= t < vocab_size), None)
            if worst is not None:
                raise bad(f"'prompt' holds the token id {worst}, outside this model's vocabulary [0, {vocab_size})",
                          "prompt")
    return out


__all__ = ["Limits", "parse_body", "check_request", "check_model", "json_depth", "too_large", "SEED_MAX",
           "UNSUPPORTED", "CHAT_UNSUPPORTED"]
