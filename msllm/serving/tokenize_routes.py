"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's request and response shapes
(``vllm/entrypoints/openai/protocol.py``: ``TokenizeCompletionRequest``, ``TokenizeChatRequest``,
``TokenizeResponse``, ``DetokenizeRequest``, ``DetokenizeResponse``):

* tokenize a prompt: ``{"model"?, "prompt": str, "add_special_tokens": true}`` (true: the
  tokenizer's BOS rule, as ``/v1/completions`` encodes text; false: the text alone);
* tokenize a chat: ``{"model"?, "messages": [...], "add_generation_prompt": true}``: the ids
  ``/v1/chat/completions`` would prefill (the server's chat template, ending with the assistant's
  opening; ``add_generation_prompt: false`` is refused: the server renders chats one way only);
* both answer ``{"count": n, "max_model_len": context, "tokens": [ids], "token_strs": null}``
  (with ``"return_token_strs": true``, ``token_strs`` holds each id's vocabulary piece);
* detokenize: ``{"model"?, "tokens": [ids]}`` -> ``{"prompt": text}``.

``model`` is optional as in vLLM; when given it must be the served one (404 otherwise). Errors are
OpenAI's error object, naming the field.
"""

from __future__ import annotations

from msllm.serving.protocol import bad, messages_error
from msllm.serving.validate import Limits, check_bool, check_messages, check_model, is_int


def _model(body: dict, served: str) -> None:
    if body.get("model") is not None:        # optional here (vLLM); when given, checked as on /v1
        check_model(body["model"], served)


def tokenize_body(body: dict, served: str, tokenizer, template, context: int, limits: Limits) -> dict:
    """A ``/tokenize`` body -> vLLM's ``TokenizeResponse``. Raises ApiError 400 naming the field."""
    from msllm.errors import MsllmError
    from msllm.generation.prompts import _messages_record, encode_turns

    _model(body, served)
    strs = check_bool("return_token_strs", body.get("return_token_strs", False), limits)
    if ("prompt" in body) == ("messages" in body):
        raise bad("send exactly one of 'prompt' (a string) or 'messages' (a chat)", "prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad("'prompt' must be a string", "prompt")
        special = check_bool("add_special_tokens", body.get("add_special_tokens", True), limits)
        ids = tokenizer.encode_with_special(body["prompt"]) if special else tokenizer.encode(body["prompt"])
    else:
        if not check_bool("add_generation_prompt", body.get("add_generation_prompt", True), limits):
            raise bad("'add_generation_prompt': false is not supported (the server renders a chat ending with "
                      "the assistant's turn)", "add_generation_prompt", "unsupported_parameter")
        try:
            record = _messages_record(check_messages("messages", body["messages"], limits), 0, "messages")
            if record.reference is not None:
                raise bad("the last message must be a user message", "messages")
            ids = encode_turns(tokenizer, template, record.turns)
        except MsllmError as exc:
            raise messages_error(exc) from None
    pieces = [tokenizer.id_to_token(int(t)) for t in ids] if strs else None
    return {"count": len(ids), "max_model_len": context, "tokens": [int(t) for t in ids], "token_strs": pieces}


def detokenize_body(body: dict, served: str, tokenizer, vocab_size: int) -> dict:
    """A ``/detokenize`` body -> vLLM's ``DetokenizeResponse``. Raises ApiError 400 naming the field."""
    _model(body, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise bad("'tokens' must be a list of token ids", "tokens")
    worst = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if worst is not None:
        raise bad(f"'tokens' holds the id {worst}, outside this model's vocabulary [0, {vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(tokens)}


__all__ = ["tokenize_body", "detokenize_body"]
