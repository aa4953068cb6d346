"""tools/serve.py, the OpenAI-compatible server, on the real SmolLM2-135M-Instruct over loopback:
the official ``openai`` client (streaming and not) gets predict's greedy outputs, lm-evaluation-
harness's ``local-completions`` backend scores MMLU requests as msllm's own evaluation does,
16 concurrent clients (2 requests each) get their own prompt's greedy continuation while bad requests get
their status codes, a full queue answers 429, a client that disconnects frees its row, and
SIGTERM finishes the requests in flight before the process exits 0. One server process serves
the session (``tests/serving/conftest.py``, started once, about 30 s, shared with
test_serving_hostile.py; the SIGTERM test, last here, ends it); every wait is bounded."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import time

import pytest

from helpers import REPO
from servetest_helpers import CONFIG, GREEDY_PROMPTS, KEY, MODEL, NEW, predict

pytestmark = pytest.mark.slow

PROMPTS = GREEDY_PROMPTS[:3]
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


def test_models_and_the_api_key(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, key="wrong")
    assert status == 401


def test_completions_equal_predict_greedy_streamed_or_not(greedy_predictions, client):
    want = [greedy_predictions[p] for p in PROMPTS]
    for p, w in zip(PROMPTS, want):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, temperature=0)
        assert r.choices[0].text == w, (p, r.choices[0].text, w)
        assert r.usage.completion_tokens <= NEW and r.choices[0].finish_reason in ("stop", "length")
        chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == w
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # several prompts in one request: one choice each, in order
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=NEW, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want


def test_chat_completions_equal_predict_with_the_chat_template(smollm2_dir, client, tmp_path):
    want = predict(smollm2_dir, tmp_path, [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS], NEW)
    for q, w in zip(QUESTIONS, want):
        msgs = [{"role": "user", "content": q}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=NEW, temperature=0)
        assert r.choices[0].message.content == w, (q, r.choices[0].message.content, w)
        parts, usage = [], None
        for c in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=NEW, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
            else:
                usage = c.usage
        assert "".join(parts) == w and usage.completion_tokens == r.usage.completion_tokens


def test_lm_eval_local_completions_scores_like_msllm_evaluation(smollm2_dir, server, tmp_path):
    """lm-eval's local-completions backend (token-id prompts, echo + logprobs, max_tokens 1) against
    the server: every request's log-likelihood within 1e-4 of msllm's own MMLU evaluation, and
    the same is_greedy."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from msllm.config import load_config
    from msllm.eval.runner import run_eval
    from msllm.eval.tasks import mmlu

    data = tmp_path / "mmlu"
    for split in ("dev", "test"):
        (data / split).mkdir(parents=True)
        shutil.copy(os.path.join(REPO, "examples", "data", "eval", "mmlu", split, f"astronomy_{split}.csv"), data / split)
    cfg = load_config(CONFIG, ["--model.model_config.seq_length=1024", f"--load_checkpoint={smollm2_dir}",
                               f"--output_dir={tmp_path / 'out'}", "--seed=0"])
    payload = run_eval(cfg, task="mmlu", data=str(data), num_fewshot=1, limit=2, batch_size=4)
    ours = [(ll, g) for d in payload["docs"] for ll, g in zip(d["loglikelihoods"], d["is_greedy"])]
    spec = mmlu.load(str(data), 1, 2)
    pairs = [(doc.context, c) for doc in spec.docs for c in doc.continuations]
    os.environ["OPENAI_API_KEY"] = KEY
    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=MODEL, tokenizer=smollm2_dir,
                             tokenizer_backend="huggingface", tokenized_requests=True, max_length=1024,
                             num_concurrent=1, max_retries=1)
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    assert len(got) == len(ours) == 8
    diffs = [abs(a[0] - b[0]) for a, b in zip(got, ours)]
    print(f"local-completions vs msllm eval: max |loglikelihood diff| {max(diffs):.2e}")
    assert max(diffs) < 1e-4
    assert [bool(a[1]) for a in got] == [bool(b[1]) for b in ours]


def test_concurrent_clients_get_their_own_greedy_outputs_and_bad_requests_their_codes(server, client):
    """16 clients x 2 requests at once (8 different prompts and lengths, so that rows of different
    lengths share batches), batched by the engine: each answer equals the same request's answer
    alone; bad requests sent meanwhile get 400 (404 for an unknown model, as OpenAI) with OpenAI's
    error object; the server answers afterwards."""
    kinds = [(f"Question {i}: {PROMPTS[i % 3]}", 4 + (i * 5) % 17) for i in range(8)]
    alone = {k: client.completions.create(model=MODEL, prompt=k[0], max_tokens=k[1], temperature=0).choices[0].text
             for k in kinds}                     # references one by one (each its own batch)
    before = server.health()["batches"]

    def one_client(c):
        out = []
        for r in range(2):
            p, n = kinds[(c + 3 * r) % 8]
            out.append(((c, r, p, n), client.completions.create(model=MODEL, prompt=p, max_tokens=n,
                                                                temperature=0).choices[0].text))
        return out

    bad = [(None, b"{not json"), ({"model": "nope", "prompt": "x"}, None),
           ({"model": MODEL, "prompt": "x", "max_tokens": -3}, None),
           ({"model": MODEL, "prompt": [[5] * 9000], "max_tokens": 1}, None),
           ({"model": MODEL, "prompt": "x", "n": 9}, None)]
    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one_client, c) for c in range(16)]
        codes = [server.post("/v1/completions", body, raw=raw) for body, raw in bad]
        results = [x for f in futures for x in f.result(timeout=900)]
    assert [c for c, _ in codes] == [400, 404, 400, 400, 400]
    assert all(set(b["error"]) == {"message", "type", "param", "code"} for _, b in codes)
    assert codes[3][1]["error"]["code"] == "context_length_exceeded"
    assert len(results) == 32 and len({k[:2] for k, _ in results}) == 32   # none lost, none twice
    for (c, r, p, n), text in results:
        assert text == alone[(p, n)], (c, r, p, n)
    h = server.health()
    assert h["max_batch_seen"] > 1 and h["batches"] - before < 32       # they were batched
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0).choices[0].text


def test_a_full_queue_answers_429(server):
    """With the 8 rows busy (8 long streams, each read until its first token) 24 more requests get
    exactly 16 places in the queue (``--max_queue 16``) and 8 answers 429 with Retry-After; once the
    long streams' clients leave, the 16 queued ones are served, and the server answers afterwards."""
    import http.client

    port = int(server.url.rsplit(":", 1)[1])
    long_body = json.dumps({"model": MODEL, "prompt": "Count to one thousand:", "stream": True, "max_tokens": 2000,
                            "temperature": 0})
    streams = []
    for _ in range(8):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", long_body, {"Content-Type": "application/json",
                                                            "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")          # its row is decoding
        streams.append(conn)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    with cf.ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(server.post, "/v1/completions", body) for _ in range(24)]
        t = time.time()
        while sum(f.done() for f in futures) < 8:              # the 8 the queue cannot take answer at once
            assert time.time() - t < 120
            time.sleep(0.05)
        early = [f.result()[0] for f in futures if f.done()]
        for conn in streams:                                   # the long streams' clients leave
            conn.sock.close()
            conn.close()
        codes = [f.result(timeout=600)[0] for f in futures]
    assert early == [429] * 8, early
    assert codes.count(429) == 8 and codes.count(200) == 16, codes
    assert server.post("/v1/completions", dict(body, max_tokens=2))[0] == 200


def test_a_client_that_disconnects_frees_its_row(server):
    """A streamed request for 2000 tokens whose client goes away after a few chunks: its row stops
    (cancelled), far short of 2000 tokens, and the engine goes idle."""
    import http.client

    h0 = server.health()
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Once upon a time", "stream": True,
                                                        "max_tokens": 2000, "temperature": 0}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.read(200)
    conn.close()
    t = time.time()
    while True:
        h = server.health()
        if h["cancelled_rows"] > h0["cancelled_rows"] and not h["busy"]:
            break
        assert time.time() - t < 120, h
        time.sleep(0.2)
    assert h["tokens_generated"] - h0["tokens_generated"] < 2000


def test_sigterm_finishes_requests_in_flight_then_exits_0(server, client):
    """Last (the server stops): a streamed request under way when SIGTERM arrives runs to its
    end ([DONE]); the process then exits 0 and the port is closed."""
    stream = client.completions.create(model=MODEL, prompt="List the planets:", max_tokens=40, temperature=0,
                                       stream=True)
    it = iter(stream)
    first = next(it)
    server.proc.send_signal(signal.SIGTERM)
    rest = list(it)
    assert rest and rest[-1].choices[0].finish_reason in ("stop", "length")
    assert server.proc.wait(120) == 0, server.log.read_text()[-3000:]
    with pytest.raises(OSError):
        server.health()
    assert first.choices[0].text is not None
