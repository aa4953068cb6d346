"""Structured output: OpenAI's ``response_format`` (``json_object``, ``json_schema``) through llguidance.

Why llguidance (``llguidance`` 1.9.1, MIT, Microsoft; the structured-output backend of vLLM's
``guidance`` option and of llama.cpp): of the three libraries the issue names it is the one that
installs with no further dependency here (``pip install --dry-run``: llguidance alone;
``outlines-core`` alone too, but it compiles a whole-vocabulary index per schema up front;
``xgrammar`` 0.2.8 pulls ``triton`` and ``apache-tvm-ffi``), it takes the served
``tokenizer.json`` as it is (``LLTokenizer(tokenizer_json_string)``, no ``transformers``), and it
computes each step's token mask lazily from an Earley parser, so a new schema costs no
compile-time index. Measured (``benchmarks/grammar_speed.py``, SmolLM2's 49,152-id tokenizer, three
schemas, 3 alternating rounds on the Intel Xeon; BENCHMARKS.md "Structured output"): per token
(mask + accept) llguidance 9-13 us median, xgrammar 1.6-6.3 us, outlines-core 2-391 us; per schema
llguidance 0.1 ms, xgrammar 4-6 ms, outlines-core 54 ms to 5.4 s (``{"type": "object"}`` builds an
index over the whole vocabulary). A decode step here is 30-100 ms, so every library's per-token cost
is under 0.05% of it; what separates them is the per-request compile and the dependencies, and
llguidance is best on both.

How a row is constrained: before each token the row's :class:`RowGuide` fills llguidance's
bitmask of the tokens the grammar allows next and sets every other logit to -inf
(``llguidance.numpy.apply_token_bitmask_inplace``); the token chosen (greedy or sampled, the row's
own settings) is then consumed by the matcher. When the JSON value is complete only the EOS ids
are allowed, so the row ends with ``finish_reason`` ``stop`` and its text parses and validates.
A row cut by ``max_tokens`` (``finish_reason`` ``length``) is a prefix of such a text, as with
OpenAI. Log-probabilities stay those of the raw logits.

Request shapes (OpenAI API reference, ``response_format``): ``{"type": "text"}``;
``{"type": "json_object"}`` (any JSON object); ``{"type": "json_schema", "json_schema": {"name":
str, "schema": {...}, "strict": bool, "description": str}}``. A schema llguidance cannot compile
is a 400 naming ``response_format`` with llguidance's message, and so is one that no finite value
satisfies (:mod:`msllm.serving.schema_finite`: every value would contain itself).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Optional

import numpy as np

from msllm.serving.protocol import bad
from msllm.serving.schema_finite import has_finite_value

# JSON laid out as Python's json.dumps does (", " and ": ", no other whitespace): llguidance's
# default allows any run of whitespace between tokens, and a model (or, in the tests, random
# logits) can then emit whitespace without end and never close the value. A schema's own
# "x-guidance" options override these (llguidance applies defaults -> x-guidance -> overrides).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_CACHE = 64   # schemas whose checked grammar StructuredOutput keeps


def check_response_format(key: str, v, limits) -> Optional[dict]:
    """``response_format``'s shape -> the JSON schema to follow (None for ``text``). Raises ApiError 400."""
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad("'response_format' must be an object with a 'type'", key)
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad("'response_format.json_schema' must be an object with a string 'name' and a 'schema'", key)
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise bad("'response_format.json_schema.schema' must be a JSON Schema object", key)
        return schema
    raise bad(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", key)


class StructuredOutput:
    """The served tokenizer as llguidance sees it (built on first use, about 1 s) and the grammars.

    Args:
        tokenizer: msllm's tokenizer; only a ``tokenizer.json`` one (``HFTokenizer``) is supported.
        vocab_size: the model's logits width; eos_ids: the ids that end a row.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, int(vocab_size), [int(e) for e in eos_ids]
        self._ll = None
        self._lock = threading.Lock()
        # schema (its JSON text, key order kept: llguidance writes properties in that order) -> checked grammar,
        # the most recently used last; a client that sends one schema with every request compiles, checks and
        # probes it once, not once per request
        self._grammars: OrderedDict = OrderedDict()

    def ll_tokenizer(self):
        """llguidance's ``LLTokenizer`` of the served tokenizer. Raises ApiError 400 for a
        SentencePiece tokenizer (llguidance needs the ``tokenizer.json`` form)."""
        inner = getattr(self.tokenizer, "_tok", None)
        if inner is None or not hasattr(inner, "to_str"):
            raise bad("'response_format' needs a model served with a tokenizer.json tokenizer", "response_format",
                      "unsupported_parameter")
        with self._lock:
            if self._ll is None:
                import llguidance

                self._ll = llguidance.LLTokenizer(inner.to_str(), n_vocab=self.vocab_size, eos_token=self.eos)
        return self._ll

    def grammar(self, schema: dict) -> str:
        """The llguidance grammar of a JSON schema, checked against the tokenizer; the last
        :data:`GRAMMAR_CACHE` schemas' grammars are kept (a refused schema is not, and is checked again).
        Raises ApiError 400."""
        key = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            hit = self._grammars.get(key)
            if hit is not None:
                self._grammars.move_to_end(key)
                return hit
        g = self._checked_grammar(schema)
        with self._lock:
            self._grammars[key] = g
            while len(self._grammars) > GRAMMAR_CACHE:
                self._grammars.popitem(last=False)
        return g

    def _checked_grammar(self, schema: dict) -> str:
        import llguidance

        ll = self.ll_tokenizer()
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as exc:
            raise bad(f"'response_format': {exc}", "response_format") from None
        problem = llguidance.LLMatcher.validate_grammar(g, ll)
        if problem:
            raise bad(f"'response_format': the schema cannot be followed: {problem}", "response_format")
        if not has_finite_value(schema):   # it would compile, start, and never finish (schema_finite.py)
            raise bad("'response_format': the schema has no finite value: a required property or item needs a "
                      "value of its own schema at every depth", "response_format")
        # its first token: whatever else llguidance's matcher cannot start fails here, where
        # validate_grammar passed it; the matcher would then allow only EOS and the answer be empty
        probe = RowGuide(ll, g, self.vocab_size)
        probe.first_mask()
        return g

    def guide(self, grammar: str) -> "RowGuide":
        """A fresh matcher for one row (engine thread)."""
        return RowGuide(self.ll_tokenizer(), grammar, self.vocab_size)


class RowGuide:
    """One row's grammar state: :meth:`mask` before choosing a token, :meth:`accept` after."""

    def __init__(self, ll_tokenizer, grammar: str, vocab_size: int):
        import llguidance
        from llguidance.numpy import allocate_token_bitmask

        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        self._check()
        self.bits = allocate_token_bitmask(1, vocab_size)

    def _check(self) -> None:
        """ApiError 400 (the request's schema is the cause) once the matcher is in its error state;
        the message keeps llguidance's first line (the rest dumps the parser's state)."""
        if self.matcher.is_error():
            first = self.matcher.get_error().strip().splitlines()[0][:300]
            raise bad(f"'response_format': the schema could not be followed to a complete value: {first}",
                      "response_format", "schema_not_followed")

    def first_mask(self) -> None:
        """Compute the first token's mask only to see that the grammar can start (400 otherwise)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self.bits, 0)
        self._check()

    def mask(self, logits_row: np.ndarray) -> np.ndarray:
        """(V,) float32 -> a copy with every token the grammar forbids next at -inf; ApiError 400
        when the grammar has failed (llguidance then allows only EOS)."""
        from llguidance.numpy import apply_token_bitmask_inplace, fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self.bits, 0)
        self._check()
        out = np.array(logits_row, dtype=np.float32)[None]
        apply_token_bitmask_inplace(out, self.bits)
        return out[0]

    def accept(self, token: int) -> None:
        """Advance past ``token``; ApiError 400 if the grammar fails on it (that row fails alone)."""
        if not self.matcher.consume_token(int(token)):
            self._check()
            raise bad(f"'response_format': the grammar refused token {int(token)}", "response_format",
                      "schema_not_followed")

    def finish(self) -> None:
        """At EOS: ApiError 400 unless the text so far is a complete value of the schema (never
        answer ``stop`` with text that does not parse)."""
        self._check()
        if not self.matcher.is_accepting():
            raise bad("'response_format': the output ended before the schema's value was complete",
                      "response_format", "schema_not_followed")


__all__ = ["StructuredOutput", "RowGuide", "check_response_format"]
