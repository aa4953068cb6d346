"""msllm/serving/structured.py without a model: llguidance's grammar of a JSON schema, on the real
SmolLM2 tokenizer (tokenizer.json), steers a row whose logits are random noise (the hardest case:
no model preference for JSON at all) to a text that parses and validates against the schema with
``jsonschema`` (the independent reference), for 20 seeds, greedy and sampled; bad schemas are 400s
naming ``response_format``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from msllm.serving.protocol import ApiError

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colors", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def structured(smollm2_dir):
    from msllm.data.tokenizer import load_tokenizer
    from msllm.serving.structured import StructuredOutput

    tok = load_tokenizer(smollm2_dir)
    return tok, StructuredOutput(tok, 49152, [2])


@pytest.mark.parametrize("sampled", [False, True])
def test_random_logits_follow_the_schema(structured, sampled):
    import jsonschema

    from msllm.generation import processors
    from msllm.config_generation import DecodeSettings

    tok, so = structured
    grammar = so.grammar(SCHEMA)
    settings = DecodeSettings(do_sample=sampled, temperature=1.0, top_k=0, top_p=1.0)
    for seed in range(20):
        print("seed", seed)
        rng = np.random.default_rng(seed)
        guide, ids = so.guide(grammar), []
        for _ in range(300):
            logits = rng.standard_normal(49152).astype(np.float32) * 5
            t = int(processors.choose(guide.mask(logits)[None], settings, rng)[0])
            if t == 2:
                break
            guide.accept(t)
            ids.append(t)
        else:
            raise AssertionError(f"seed {seed}: no end within 300 tokens: {tok.decode(ids)!r}")
        value = json.loads(tok.decode(ids))
        jsonschema.validate(value, SCHEMA)


def test_json_object_and_bad_schemas(structured):
    tok, so = structured
    g = so.grammar({"type": "object"})
    guide = so.guide(g)
    masked = guide.mask(np.zeros(49152, np.float32))
    allowed = np.flatnonzero(np.isfinite(masked))
    assert 0 < len(allowed) < 49152 and all(tok.decode([int(t)]).lstrip().startswith("{") for t in allowed[:50])
    # {"$ref": "#"} has no finite value: llguidance's validate_grammar passes it and its matcher then
    # allows only EOS (an empty "stop" answer before msllm's checks); an object that requires itself compiles
    # and starts ("{"), and would never finish (msllm/serving/schema_finite.py)
    itself = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    for schema in ({"type": "nope"}, {"$ref": "#/missing"}, {"$ref": "#"}, itself):
        with pytest.raises(ApiError) as e:
            so.grammar(schema)
        assert e.value.status == 400 and e.value.param == "response_format", schema
    assert "finite" in e.value.message
    assert so.grammar(dict(itself, required=[]))    # the same object with "a" optional: {} will do
    with pytest.raises(ApiError) as e:
        guide.finish()                                 # EOS before the object began: no "stop" answer
    assert e.value.status == 400 and "complete" in e.value.message
    with pytest.raises(ApiError) as e:
        guide.accept(int(tok.encode("hello")[0]))      # a token the grammar forbids: that row's failure
    assert e.value.status == 400 and e.value.param == "response_format"
    done = so.guide(so.grammar({"type": "integer"}))
    for t in tok.encode("42"):
        done.accept(t)
    done.finish()                                      # a complete value: EOS is a "stop"


def test_a_sentencepiece_tokenizer_is_refused_by_name():
    from helpers import TOKENIZER
    from msllm.data.tokenizer import load_tokenizer
    from msllm.serving.structured import StructuredOutput

    with pytest.raises(ApiError) as e:
        StructuredOutput(load_tokenizer(TOKENIZER), 32000, [2]).grammar({"type": "object"})
    assert e.value.param == "response_format" and "tokenizer.json" in e.value.message


def test_a_repeated_schema_is_compiled_checked_and_probed_once(structured, monkeypatch):
    import llguidance

    from msllm.serving import structured as mod
    from msllm.serving.structured import StructuredOutput

    tok, _ = structured
    so = StructuredOutput(tok, 49152, [2])
    calls = []
    real = llguidance.LLMatcher.grammar_from_json_schema

    def counted(schema, *args, **kwargs):
        calls.append(json.dumps(schema))
        return real(schema, *args, **kwargs)

    monkeypatch.setattr(llguidance.LLMatcher, "grammar_from_json_schema", staticmethod(counted))
    g = so.grammar(SCHEMA)
    assert so.grammar(json.loads(json.dumps(SCHEMA))) == g and len(calls) == 1       # an equal schema: kept
    swapped = dict(SCHEMA, properties=dict(reversed(list(SCHEMA["properties"].items()))))
    assert so.grammar(swapped) != g and len(calls) == 2     # another property order is another layout
    for bad_schema in ({"type": "nope"}, {"type": "nope"}):  # a refused schema is checked every time
        with pytest.raises(ApiError):
            so.grammar(bad_schema)
    assert len(calls) == 4
    monkeypatch.setattr(mod, "GRAMMAR_CACHE", 2)
    so.grammar({"type": "integer"})                          # a third kept schema: the least recent goes
    assert len(so._grammars) == 2
    so.grammar(SCHEMA)
    assert len(calls) == 6                                   # SCHEMA had been evicted (swapped was more recent)
