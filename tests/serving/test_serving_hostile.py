"""tools/serve.py against hostile and demanding clients, on the real SmolLM2-135M-Instruct (the session's
one server process, ``tests/serving/conftest.py``): bad requests of every kind arrive while honest
streams decode, each gets its 4xx as OpenAI's error object, every honest stream equals
``run_msllm.py --run_mode predict``'s greedy output, nothing bad reaches the engine, and the server
answers afterwards; a seeded sampling request (``n`` = 2) and stop-string requests equal predict
with the same settings; ``/tokenize`` equals the ``tokenizers`` library's ids, chat
``logprobs`` agree with ``/v1/completions`` on the same ids; ``/metrics`` counts what was served;
the start-up log names the warmed-up shapes; 8 sampled ``json_schema`` answers validate with
``jsonschema``. Seeds fixed: sampling seed :data:`SEED`."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re

import pytest

from servetest_helpers import GREEDY_PROMPTS, KEY, MODEL, NEW, predict

pytestmark = pytest.mark.slow

SEED = 1234
HONEST = GREEDY_PROMPTS[:4]
STOP_PROMPT = GREEDY_PROMPTS[4]

BAD = [  # (what, body or raw bytes, endpoint, status, param)
    ("negative seed", {"prompt": "x", "seed": -1, "temperature": 1.0}, "c", 400, "seed"),
    ("seed beyond int64", {"prompt": "x", "seed": 2 ** 64}, "c", 400, "seed"),
    ("empty prompt", {"prompt": ""}, "c", 400, "prompt"),
    ("empty id list", {"prompt": []}, "c", 400, "prompt"),
    ("out-of-vocabulary id", {"prompt": [[1, 49152]]}, "c", 400, "prompt"),
    ("NaN", b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(), "c", 400, None),
    ("Infinity", b'{"model": "%s", "prompt": "x", "top_p": Infinity}' % MODEL.encode(), "c", 400, None),
    ("deep JSON", b'{"model": "m", "prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", "c", 400, None),
    ("n too large", {"prompt": "x", "n": 9}, "c", 400, "n"),
    ("unknown model", {"prompt": "x", "model": "gpt-4o"}, "c", 404, "model"),
    ("top_p 0", {"prompt": "x", "top_p": 0}, "c", 400, "top_p"),
    ("five stops", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "c", 400, "stop"),
    ("logprobs with stream", {"prompt": "x", "logprobs": 2, "stream": True}, "c", 400, "logprobs"),
    ("beyond the context", {"prompt": "x", "max_tokens": 100000}, "c", 400, "max_tokens"),
    ("too many prompts", {"prompt": ["x"] * 65}, "c", 400, "prompt"),
    ("empty messages", {"messages": []}, "chat", 400, "messages"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "chat", 400, "messages"),
    ("top_logprobs 50", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
     "chat", 400, "top_logprobs"),
    ("tools", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "chat", 400,
     "tools"),
    ("not JSON", b"{oops", "chat", 400, None),
    ("lone surrogate", b'{"model": "%s", "prompt": "ab\\ud800cd"}' % MODEL.encode(), "c", 400, "prompt"),
    ("more choices than the queue holds", {"prompt": ["a", "b", "c"], "n": 8}, "c", 400, "n"),   # --max_queue 16
    ("repetition_penalty (vLLM)", {"prompt": "x", "repetition_penalty": 5}, "c", 400, "repetition_penalty"),
    ("echo+logprobs over the scoring limit", {"prompt": [1] * 2049, "echo": True, "logprobs": 0, "max_tokens": 0},
     "c", 400, "echo"),
    ("schema with no finite value", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}, "chat", 400, "response_format"),
]


def send_bad(server, case):
    what, body, where, status, param = case
    path = "/v1/completions" if where == "c" else "/v1/chat/completions"
    if isinstance(body, bytes):
        return server.post(path, None, raw=body)
    return server.post(path, dict({"model": MODEL}, **body))


def oversized(server) -> int:
    """A 5 MiB body (the limit is 4 MiB): 413, announced by Content-Length and answered unread."""
    import http.client

    port = int(server.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"x" * (5 << 20) + b'"}'
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                       "Authorization": f"Bearer {KEY}"})
    except (BrokenPipeError, ConnectionResetError):
        pass   # the server answered and closed before the whole body went out
    resp = conn.getresponse()
    status, payload = resp.status, json.loads(resp.read())
    conn.close()
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    return status


def metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    status, data = server.get("/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(data.decode()) for s in f.samples}


@pytest.fixture(scope="module")
def greedy_ref(greedy_predictions):
    """predict's greedy outputs for the honest prompts and the stop prompt (conftest.py: one predict run)."""
    return [greedy_predictions[p] for p in HONEST + [STOP_PROMPT]]


def test_bad_requests_get_their_4xx_while_honest_streams_decode(server, client, greedy_ref):
    assert server.proc.poll() is None, "the session's server has stopped (SIGTERM test ran first?)"
    h0, m0 = server.health(), metrics(server)
    print("greedy decoding for the honest streams; bad requests never sample")

    def honest(p):
        stream = client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream)

    with cf.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(honest, p) for p in HONEST]
        bad = [pool.submit(send_bad, server, case) for case in BAD]
        big = pool.submit(oversized, server)
        got = [f.result(timeout=600) for f in streams]
        answers = [f.result(timeout=600) for f in bad]
        big_status = big.result(timeout=600)
    assert got == greedy_ref[:len(HONEST)]
    for (what, _, _, status, param), (code, body) in zip(BAD, answers):
        assert code == status, (what, code, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, what
        if param is not None:
            assert body["error"]["param"] == param, (what, body)
    assert big_status == 413
    h = server.health()
    assert h["status"] == "ok" and h["failed_rows"] == h0["failed_rows"]       # nothing bad reached the engine
    m = metrics(server)
    assert m[("msllm:request_success_total", (("finished_reason", "length"),))] - \
        m0.get(("msllm:request_success_total", (("finished_reason", "length"),)), 0) \
        + m.get(("msllm:request_success_total", (("finished_reason", "stop"),)), 0) \
        - m0.get(("msllm:request_success_total", (("finished_reason", "stop"),)), 0) == len(HONEST)
    assert m[("msllm:time_to_first_token_seconds_count", ())] - m0[("msllm:time_to_first_token_seconds_count", ())] \
        == len(HONEST)
    made = m[("msllm:generation_tokens_total", ())] - m0[("msllm:generation_tokens_total", ())]
    assert made == h["tokens_generated"] - h0["tokens_generated"] >= len(HONEST)
    assert m[("msllm:num_requests_running", ())] == 0
    again = client.completions.create(model=MODEL, prompt=HONEST[0], max_tokens=NEW, temperature=0)
    assert again.choices[0].text == greedy_ref[0]
    # a temperature float32 cannot divide by (1e-300 underflows to 0) is greedy, as in vLLM (below 1e-5)
    tiny = client.completions.create(model=MODEL, prompt=HONEST[0], max_tokens=NEW, temperature=1e-300, seed=3)
    assert tiny.choices[0].text == greedy_ref[0]


def test_a_client_gone_before_its_whole_answer_stops_its_rows(server):
    """A request answered whole (no stream) whose client closes the connection is cancelled within
    the app's disconnect poll, not decoded to its end (470 tokens here) while others wait."""
    import http.client
    import time

    before = server.health()
    port = int(server.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
                       "max_tokens": 470, "temperature": 0, "n": 2})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json",
                                                        "Authorization": f"Bearer {KEY}"})
    t0 = time.time()
    while server.health()["tokens_generated"] <= before["tokens_generated"]:   # its rows are decoding
        assert time.time() - t0 < 120
        time.sleep(0.05)
    conn.sock.close()                                # the client leaves
    conn.close()
    t1 = time.time()
    while True:
        h = server.health()
        if h["cancelled_rows"] >= before["cancelled_rows"] + 2 and not h["busy"]:
            break
        assert time.time() - t1 < 30, h
        time.sleep(0.05)
    made = h["tokens_generated"] - before["tokens_generated"]
    print(f"cancelled {time.time() - t1:.2f} s after the client left; {made} tokens made of 2 x 470")
    assert made < 2 * 470
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})[0] == 200


def test_warmup_is_logged(server):
    log = server.log.read_text()
    line = next((x for x in log.splitlines() if "warmed up" in x), None)
    assert line is not None and "'decode', 1, 1, 512" in line and "'decode', 8, 1, 512" in line, log[-2000:]
    # --warmup_slots 1024 (servetest_helpers.start_server), the default --prefill_chunk_size 512:
    # the decode step over the widened cache and a long prompt's chunk over its own 1024 slots
    assert "'decode', 8, 1, 1024" in line and "'extend', 1, 512, 1024" in line, line
    assert re.search(r"warmed up \d+ graph shapes in \d+\.\d s", line), line
    assert "prefill chunk 512 tokens" in log and "prefix caching off" in log


def test_seeded_sampling_and_stop_strings_equal_predict(smollm2_dir, server, client, greedy_ref, tmp_path):
    sampled = predict(smollm2_dir, tmp_path, [{"prompt": HONEST[0]}], NEW, template="none",
                      extra=("--generation_config.do_sample=True", "--generation_config.temperature=0.9",
                             "--generation_config.top_k=40", "--generation_config.top_p=0.95",
                             f"--generation_config.seed={SEED}", "--generation_config.batch_size=1"))[0]
    print("sampling seed", SEED, "->", repr(sampled))
    r = client.completions.create(model=MODEL, prompt=HONEST[0], max_tokens=NEW, temperature=0.9, top_p=0.95,
                                  seed=SEED, n=2, extra_body={"top_k": 40})
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts[0] == sampled                       # choice 0 samples with the seed itself
    assert len(texts) == 2 and r.usage.prompt_tokens == len(server.post(
        "/tokenize", {"prompt": HONEST[0]})[1]["tokens"])   # the prompt counted once for n = 2
    # a stop string taken from the middle of predict's greedy answer: the answer cut before it
    full = greedy_ref[-1]
    words = full.split()
    assert len(words) > 3, full
    stop = " " + words[2]
    want = full[:full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=NEW, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=NEW, temperature=0,
                                              stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_tokenize_detokenize_and_chat_logprobs(smollm2_dir, server, client):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))
    text = "Hello world, how are you?"
    status, out = server.post("/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and out["tokens"] == hf.encode(text, add_special_tokens=False).ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 8192
    assert server.post("/detokenize", {"tokens": out["tokens"]}) == (200, {"prompt": text})
    assert server.post("/detokenize", {"model": "other", "tokens": [1]})[0] == 404
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    status, chat_ids = server.post("/tokenize", {"model": MODEL, "messages": msgs})
    assert status == 200 and chat_ids["tokens"][-4:] == hf.encode("<|im_start|>assistant\n").ids
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=3, n=2)
    assert r.choices[0].message.content == r.choices[1].message.content          # greedy: n identical choices
    content = r.choices[0].logprobs.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)   # greedy: top-1
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)
    # the same ids through /v1/completions: the same tokens and log-probabilities
    c = client.completions.create(model=MODEL, prompt=chat_ids["tokens"], max_tokens=12, temperature=0, logprobs=1)
    assert c.choices[0].text == r.choices[0].message.content
    lp = c.choices[0].logprobs.token_logprobs
    assert len(lp) == len(content)
    assert max(abs(a - b.logprob) for a, b in zip(lp, content)) < 1e-5
    assert r.usage.prompt_tokens == chat_ids["count"]


def test_json_schema_outputs_parse_and_validate(server, client):
    """8 sampled chat answers under ``response_format`` json_schema (one request, n = 8, one batch;
    test_serving_structured.py drives 40 more rows, without a model) all end with ``stop`` and
    validate against the schema with ``jsonschema``; json_object gives a JSON object; a schema
    llguidance cannot follow is a 400 naming response_format."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colors"],
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                        "maxItems": 3}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "Describe a person (name, age, favourite colors) as JSON."}]
    print("sampling seeds", SEED, "..", SEED + 7)
    choices = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=1.0, seed=SEED,
                                             n=8, response_format=fmt).choices
    assert len(choices) == 8
    for c in choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)
    ask = [{"role": "user", "content": 'Answer with a JSON object {"capital": ...}: the capital of France?'}]
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    status, body = server.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})
    assert status == 400 and body["error"]["param"] == "response_format"
