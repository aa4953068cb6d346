"""Every request field's validation (msllm/serving/validate.py), table-driven, no model: each bad
body gets the status, the ``param`` and a message naming what was expected, as OpenAI's error
object; each good body passes with the normalised value. The seed range is checked against
numpy's ``default_rng`` itself (the sampler the engine uses), and the ranges against the ``openai``
client's documented limits where it states them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from msllm.serving.protocol import ApiError
from msllm.serving.validate import SEED_MAX, Limits, check_request, json_depth, parse_body

MODEL = "m"
VOCAB = 1000
LIM = Limits()


def comp(**kw):
    return dict({"model": MODEL, "prompt": "hello"}, **kw)


def chat(**kw):
    return dict({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, **kw)


# (id, body, chat?, status, param)
BAD = [
    ("no model", {"prompt": "x"}, False, 400, "model"),
    ("model not a string", comp(model=3), False, 400, "model"),
    ("unknown model", comp(model="gpt-4"), False, 404, "model"),
    ("unknown model chat", chat(model="x"), True, 404, "model"),
    ("no prompt", {"model": MODEL}, False, 400, "prompt"),
    ("empty prompt", comp(prompt=""), False, 400, "prompt"),
    ("empty prompt in list", comp(prompt=["a", ""]), False, 400, "prompt"),
    ("empty id list", comp(prompt=[]), False, 400, "prompt"),
    ("empty inner id list", comp(prompt=[[1, 2], []]), False, 400, "prompt"),
    ("prompt number", comp(prompt=5), False, 400, "prompt"),
    ("prompt mixed", comp(prompt=["a", [1]]), False, 400, "prompt"),
    ("prompt bool ids", comp(prompt=[True, False]), False, 400, "prompt"),
    ("prompt float ids", comp(prompt=[1.0, 2.0]), False, 400, "prompt"),
    ("id above vocab", comp(prompt=[1, VOCAB]), False, 400, "prompt"),
    ("negative id", comp(prompt=[[1], [-1]]), False, 400, "prompt"),
    ("too many prompts", comp(prompt=["a"] * 65), False, 400, "prompt"),
    ("prompts x n", comp(prompt=["a"] * 10, n=8), False, 400, "n"),
    ("max_tokens negative", comp(max_tokens=-1), False, 400, "max_tokens"),
    ("max_tokens float", comp(max_tokens=2.5), False, 400, "max_tokens"),
    ("max_tokens string", comp(max_tokens="3"), False, 400, "max_tokens"),
    ("max_tokens bool", comp(max_tokens=True), False, 400, "max_tokens"),
    ("chat max_tokens 0", chat(max_tokens=0), True, 400, "max_tokens"),
    ("chat max_completion_tokens 0", chat(max_completion_tokens=0), True, 400, "max_completion_tokens"),
    ("temperature above 2", comp(temperature=2.5), False, 400, "temperature"),
    ("temperature negative", comp(temperature=-0.1), False, 400, "temperature"),
    ("temperature string", comp(temperature="hot"), False, 400, "temperature"),
    ("top_p 0", comp(top_p=0), False, 400, "top_p"),
    ("top_p above 1", comp(top_p=1.01), False, 400, "top_p"),
    ("top_k below -1", comp(top_k=-2), False, 400, "top_k"),
    ("top_k float", comp(top_k=1.5), False, 400, "top_k"),
    ("seed negative", comp(seed=-1), False, 400, "seed"),
    ("seed too large", comp(seed=SEED_MAX + 1), False, 400, "seed"),
    ("seed float", comp(seed=1.0), False, 400, "seed"),
    ("n 0", comp(n=0), False, 400, "n"),
    ("n too large", comp(n=9), False, 400, "n"),
    ("n string", chat(n="2"), True, 400, "n"),
    ("best_of not n", comp(n=2, best_of=3), False, 400, "best_of"),
    ("logprobs 6", comp(logprobs=6), False, 400, "logprobs"),
    ("logprobs negative", comp(logprobs=-1), False, 400, "logprobs"),
    ("logprobs bool on completions", comp(logprobs=True), False, 400, "logprobs"),
    ("chat logprobs int", chat(logprobs=3), True, 400, "logprobs"),
    ("top_logprobs 21", chat(logprobs=True, top_logprobs=21), True, 400, "top_logprobs"),
    ("top_logprobs without logprobs", chat(top_logprobs=2), True, 400, "top_logprobs"),
    ("logprobs with stream", comp(logprobs=1, stream=True), False, 400, "logprobs"),
    ("chat logprobs with stream", chat(logprobs=True, stream=True), True, 400, "logprobs"),
    ("echo with stream", comp(echo=True, stream=True), False, 400, "echo"),
    ("echo not bool", comp(echo=1), False, 400, "echo"),
    ("stream not bool", comp(stream="yes"), False, 400, "stream"),
    ("stream_options list", comp(stream=True, stream_options=[1]), False, 400, "stream_options"),
    ("include_usage not bool", comp(stream=True, stream_options={"include_usage": 1}), False, 400,
     "stream_options"),
    ("stop 5 strings", comp(stop=["a", "b", "c", "d", "e"]), False, 400, "stop"),
    ("stop too long", comp(stop="x" * 257), False, 400, "stop"),
    ("stop number", comp(stop=3), False, 400, "stop"),
    ("stop list of numbers", comp(stop=[1]), False, 400, "stop"),
    ("messages empty", chat(messages=[]), True, 400, "messages"),
    ("messages not list", chat(messages="hi"), True, 400, "messages"),
    ("message not object", chat(messages=["hi"]), True, 400, "messages"),
    ("message no role", chat(messages=[{"content": "hi"}]), True, 400, "messages"),
    ("message content number", chat(messages=[{"role": "user", "content": 3}]), True, 400, "messages"),
    ("message image part", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), True, 400,
     "messages"),
    ("too many messages", chat(messages=[{"role": "user", "content": "a"}] * 513), True, 400, "messages"),
    ("no messages", {"model": MODEL}, True, 400, "messages"),
    ("tools", chat(tools=[{"type": "function"}]), True, 400, "tools"),
    ("logit_bias", comp(logit_bias={"1": 5}), False, 400, "logit_bias"),
    ("presence_penalty", comp(presence_penalty=0.5), False, 400, "presence_penalty"),
    ("suffix", comp(suffix="x"), False, 400, "suffix"),
    ("presence_penalty false", comp(presence_penalty=False), False, 400, "presence_penalty"),
    ("frequency_penalty string 0", comp(frequency_penalty="0"), False, 400, "frequency_penalty"),
    # vLLM's extensions that would change the output if msllm ignored them
    ("repetition_penalty", comp(repetition_penalty=5), False, 400, "repetition_penalty"),
    ("min_p", chat(min_p=0.1), True, 400, "min_p"),
    ("min_tokens", comp(min_tokens=3), False, 400, "min_tokens"),
    ("ignore_eos", comp(ignore_eos=True), False, 400, "ignore_eos"),
    ("stop_token_ids", comp(stop_token_ids=[2]), False, 400, "stop_token_ids"),
    ("guided_json", chat(guided_json={"type": "object"}), True, 400, "guided_json"),
    ("guided_choice", comp(guided_choice=["a", "b"]), False, 400, "guided_choice"),
    ("skip_special_tokens false", comp(skip_special_tokens=False), False, 400, "skip_special_tokens"),
    ("bad_words", comp(bad_words=["x"]), False, 400, "bad_words"),
    ("allowed_token_ids", chat(allowed_token_ids=[1, 2]), True, 400, "allowed_token_ids"),
    ("chat echo", chat(echo=True), True, 400, "echo"),
    ("continue_final_message", chat(continue_final_message=True), True, 400, "continue_final_message"),
    ("add_generation_prompt false", chat(add_generation_prompt=False), True, 400, "add_generation_prompt"),
    ("chat_template per request", chat(chat_template="{{ x }}"), True, 400, "chat_template"),
    ("chat_template_kwargs", chat(chat_template_kwargs={"enable_thinking": False}), True, 400,
     "chat_template_kwargs"),
    ("response_format unknown type", chat(response_format={"type": "xml"}), True, 400, "response_format"),
    ("response_format not object", chat(response_format="json"), True, 400, "response_format"),
    ("json_schema without name", chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     True, 400, "response_format"),
    ("json_schema schema not object", comp(response_format={"type": "json_schema",
                                                           "json_schema": {"name": "x", "schema": [1]}}),
     False, 400, "response_format"),
    ("user not string", comp(user=5), False, 400, "user"),
]

GOOD = [
    ("text prompt", comp(), False, "prompt", ("text", ["hello"])),
    ("id prompt", comp(prompt=[1, 999]), False, "prompt", ("ids", [[1, 999]])),
    ("id prompts", comp(prompt=[[1], [2, 3]]), False, "prompt", ("ids", [[1], [2, 3]])),
    ("seed 0", comp(seed=0), False, "seed", 0),
    ("seed max", comp(seed=SEED_MAX), False, "seed", SEED_MAX),
    ("top_k -1", comp(top_k=-1), False, "top_k", -1),
    ("temperature 0", comp(temperature=0), False, "temperature", 0),
    ("temperature 2", comp(temperature=2), False, "temperature", 2),
    ("top_p 1", comp(top_p=1), False, "top_p", 1),
    ("stop string", comp(stop="\n"), False, "stop", ("\n",)),
    ("stop empty strings dropped", comp(stop=["", "x"]), False, "stop", ("x",)),
    ("n 8", chat(n=8), True, "n", 8),
    ("best_of = n", comp(n=2, best_of=2), False, "best_of", 2),
    ("logprobs 5", comp(logprobs=5), False, "logprobs", 5),
    ("max_tokens 0 (echo scoring)", comp(max_tokens=0), False, "max_tokens", 0),
    ("top_logprobs 20", chat(logprobs=True, top_logprobs=20), True, "top_logprobs", 20),
    ("text parts joined", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}]),
     True, "messages", [{"role": "user", "content": "a\nb"}]),   # vLLM's chat_utils: "\n".join(texts)
    ("nulls are absent", comp(seed=None, stop=None, n=None), False, "seed", None),
    ("presence_penalty 0 is off", comp(presence_penalty=0), False, "model", MODEL),
    ("presence_penalty 0.0 is off", comp(presence_penalty=0.0), False, "model", MODEL),
    ("vLLM extensions at their off values", comp(repetition_penalty=1.0, min_p=0, min_tokens=0, ignore_eos=False,
                                                 stop_token_ids=[], skip_special_tokens=True, guided_json=None),
     False, "model", MODEL),
    ("vLLM chat extensions at their off values", chat(echo=False, add_generation_prompt=True, bad_words=[],
                                                      continue_final_message=False), True, "model", MODEL),
    ("unknown field ignored", comp(until=["x"], do_sample=False), False, "model", MODEL),
    ("json_object", chat(response_format={"type": "json_object"}), True, "response_format", {"type": "object"}),
    ("json_schema", chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "integer"}}}), True, "response_format", {"type": "integer"}),
    ("text format", comp(response_format={"type": "text"}), False, "response_format", None),
]


@pytest.mark.parametrize("name,body,is_chat,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_fields_get_their_status_and_name(name, body, is_chat, status, param):
    with pytest.raises(ApiError) as e:
        check_request(body, is_chat, MODEL, LIM, VOCAB)
    err = e.value
    assert (err.status, err.param) == (status, param), err.body()
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert err.body()["error"]["type"] == "invalid_request_error"
    assert param in err.message or "prompt" in err.message or "choices" in err.message or "model" in err.message


@pytest.mark.parametrize("name,body,is_chat,key,want", GOOD, ids=[g[0] for g in GOOD])
def test_good_fields_pass_normalised(name, body, is_chat, key, want):
    got = check_request(body, is_chat, MODEL, LIM, VOCAB)
    assert got.get(key) == want


def test_unknown_model_is_openais_404():
    with pytest.raises(ApiError) as e:
        check_request(comp(model="nope"), False, MODEL, LIM, VOCAB)
    assert e.value.status == 404 and e.value.body()["error"]["code"] == "model_not_found"


def test_seed_range_is_what_numpys_default_rng_accepts():
    """Every seed the validator passes seeds the engine's sampler; the negative one it refuses
    is one numpy refuses too (so refusing it up front is what keeps it out of the engine)."""
    for seed in (0, 1, SEED_MAX):
        check_request(comp(seed=seed), False, MODEL, LIM, VOCAB)
        np.random.default_rng(seed).random()
    with pytest.raises(ValueError):
        np.random.default_rng(-1)


@pytest.mark.parametrize("raw,status,what", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "m", "temperature": NaN}', 400, "NaN"),
    (b'{"model": "m", "temperature": Infinity}', 400, "Infinity"),
    (b'{"model": "m", "temperature": -Infinity}', 400, "Infinity"),
    (b"[1, 2]", 400, "JSON object"),
    (b'"text"', 400, "JSON object"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", 400, "nests deeper"),
    (b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, "nests deeper"),   # Python's parser recursion
    (b'{"p": "' + b"x" * (4 << 20) + b'"}', 413, "larger than"),
])
def test_bodies_refused(raw, status, what):
    with pytest.raises(ApiError) as e:
        parse_body(raw, LIM)
    assert e.value.status == status and what in e.value.message, e.value.message


def test_number_overflowing_to_infinity_is_refused_in_any_field():
    """Python's json reads 1e999 as inf (no parse_constant call): refused where it is, read or not."""
    assert json.loads(b'{"t": 1e999}')["t"] == float("inf")
    for raw, param in [(b'{"model": "m", "prompt": "x", "temperature": 1e999}', "temperature"),
                       (b'{"model": "m", "prompt": "x", "do_sample_extra": [1, -1e309]}', "do_sample_extra")]:
        with pytest.raises(ApiError) as e:
            parse_body(raw, LIM)
        assert e.value.param == param and "finite" in e.value.message


def test_depth_limit_counts_levels_and_allows_a_realistic_chat():
    chat_body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    assert json_depth(chat_body) == 5                 # body, messages, message, parts, part
    assert parse_body(json.dumps(chat_body).encode(), LIM) == chat_body
    assert json_depth({"a": [[[]]]}) == 4 and json_depth(3) == 0
    assert parse_body(b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}", LIM)   # 32 levels: the limit
    with pytest.raises(ApiError):
        parse_body(b'{"a": ' + b"[" * 32 + b"]" * 32 + b"}", LIM)


def test_limits_are_configurable():
    small = Limits(max_body_bytes=10, max_prompts=2, max_n=2, max_stops=1, max_stop_chars=3)
    with pytest.raises(ApiError) as e:
        parse_body(b'{"model": "m!"}', small)
    assert e.value.status == 413
    for body, param in [(comp(prompt=["a", "b", "c"]), "prompt"), (comp(n=3), "n"), (comp(stop=["a", "b"]), "stop"),
                        (comp(stop="abcd"), "stop")]:
        with pytest.raises(ApiError) as e:
            check_request(body, False, MODEL, small, VOCAB)
        assert e.value.param == param


@pytest.mark.parametrize("raw,param,path", [
    (b'{"model": "m", "prompt": "ab\\ud800cd"}', "prompt", "prompt"),
    (b'{"model": "\\ud800", "prompt": "x"}', "model", "model"),
    (b'{"model": "m", "prompt": ["ok", "\\udfff"]}', "prompt", "prompt[1]"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800"}]}', "messages", "messages[0].content"),
    (b'{"model": "m", "prompt": "x", "stop": ["\\ud83d"]}', "stop", "stop[0]"),
])
def test_lone_surrogates_are_refused_naming_where(raw, param, path):
    """JSON's \\u escapes can spell a lone surrogate, which Python's json accepts and no tokenizer or
    UTF-8 writer does (a 500 before this check): 400 naming the field and the path to the string."""
    with pytest.raises(ApiError) as e:
        parse_body(raw, LIM)
    assert (e.value.status, e.value.param) == (400, param), e.value.body()
    assert f"'{path}'" in e.value.message and "surrogate" in e.value.message


@pytest.mark.parametrize("raw,param", [
    (rb'{"\ud800": 1, "model": "m"}', None),                           # a top-level key: no field to name
    (rb'{"model": "m", "x": {"a\ud800": 1}}', "x"),
    (rb'{"model": "m", "messages": [{"role": "user", "content": "a", "\udfff": 2}]}', "messages"),
])
def test_lone_surrogates_in_keys_are_refused_and_the_error_renders(raw, param):
    """The error names a bad key with its escape, so the answer itself encodes as UTF-8 (Starlette's
    JSONResponse does: a message holding the raw surrogate would turn the 400 into a 500)."""
    from starlette.responses import JSONResponse

    with pytest.raises(ApiError) as e:
        parse_body(raw, LIM)
    assert (e.value.status, e.value.param) == (400, param) and "surrogate" in e.value.message
    assert b"\\ud" in JSONResponse(e.value.body()).body


def test_a_large_id_list_is_scanned_without_a_look_at_each_id():
    ids = list(range(400_000))
    body = parse_body(json.dumps({"model": "m", "prompt": ids}).encode(), LIM)
    assert body["prompt"] == ids and json_depth(body) == 2


def test_valid_non_ascii_and_surrogate_pairs_pass():
    body = parse_body(rb'{"model": "m", "prompt": "h\u00e9llo \ud83d\ude00 \u4e2d"}', LIM)   # a pair: one emoji
    assert body["prompt"] == "h\u00e9llo \U0001F600 \u4e2d"
