"""msllm/serving/app.py's routes without a model (an engine stand-in with the attributes the app
reads), through Starlette's own ``TestClient``: ``/health`` follows the engine thread (503 once it
has died, and requests are then refused with 503 instead of queued), a body over the limit is 413
whether ``Content-Length`` announces it or a chunked upload reveals it, errors are OpenAI's
object, ``/metrics`` is Prometheus text; and ``tools/serve.py`` takes the API key from the flag, a
file or ``MSLLM_API_KEY``."""

from __future__ import annotations

import importlib.util
import os
import queue
from types import SimpleNamespace

import pytest

from helpers import REPO, TOKENIZER
from msllm.serving.validate import Limits

MODEL = "m"


class FakeEngine:
    """What build_app reads of an Engine; ``submit`` records jobs and never answers."""

    def __init__(self):
        from msllm.serving.metrics import ServerMetrics

        self.config = SimpleNamespace(vocab_size=32000)
        self.is_alive = True
        self.submitted = []
        self.queue = queue.Queue()
        self.batch = SimpleNamespace(active=0, rows=[], buffer=0)
        self.metrics = ServerMetrics()
        self.metrics.bind(self)

    def alive(self):
        return self.is_alive

    def stats(self):
        return {"queued": 0}

    def submit(self, job, sink):
        self.submitted.append(job)
        sink(("done", "length", {"text": "", "completion_tokens": 0, "prompt_tokens": len(job.prompt),
                                 "prompt_logprobs": None, "logprobs": []}))
        return SimpleNamespace(cancel=lambda: None)


@pytest.fixture()
def app_client():
    from starlette.testclient import TestClient

    from msllm.data.tokenizer import load_tokenizer
    from msllm.serving.app import build_app

    eng = FakeEngine()
    app = build_app(eng, MODEL, load_tokenizer(TOKENIZER), None, 64, None, Limits(max_body_bytes=200))
    with TestClient(app) as c:
        yield eng, c


def test_health_follows_the_engine_thread(app_client):
    eng, c = app_client
    assert c.get("/health").status_code == 200
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and len(eng.submitted) == 1
    eng.is_alive = False
    r = c.get("/health")
    assert r.status_code == 503 and r.json()["status"] != "ok"
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead" and len(eng.submitted) == 1


def test_body_limit_is_413_announced_or_streamed(app_client):
    eng, c = app_client
    big = b'{"model": "m", "prompt": "' + b"x" * 300 + b'"}'
    r = c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}

    def chunks():                      # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b" " * 50

    r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert c.post("/tokenize", content=big).status_code == 413
    assert eng.submitted == []


def test_errors_routes_and_metrics(app_client):
    eng, c = app_client
    r = c.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert c.get("/nope").status_code == 404
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "seed": -5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200          # no template: plain user turn
    r = c.post("/detokenize", json={"tokens": [1, 15043]})
    assert r.status_code == 200 and r.json()["prompt"] == "Hello"
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "msllm:num_requests_running" in r.text and "msllm:time_to_first_token_seconds_bucket" in r.text


def test_serve_reads_the_api_key_from_flag_file_or_environment(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("serve_tool", os.path.join(REPO, "tools", "serve.py"))
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    from msllm.errors import MsllmError

    p = serve.build_parser()
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored\n")
    monkeypatch.setenv("MSLLM_API_KEY", "from-env")
    base = ["--config", "x"]
    assert serve.api_key(p.parse_args(base + ["--api_key", "flag", "--api_key_file", str(key_file)])) == "flag"
    assert serve.api_key(p.parse_args(base + ["--api_key_file", str(key_file)])) == "from-file"
    assert serve.api_key(p.parse_args(base)) == "from-env"
    monkeypatch.delenv("MSLLM_API_KEY")
    assert serve.api_key(p.parse_args(base)) is None
    with pytest.raises(MsllmError, match="api_key_file"):
        serve.api_key(p.parse_args(base + ["--api_key_file", str(tmp_path / "missing")]))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(MsllmError, match="empty"):
        serve.api_key(p.parse_args(base + ["--api_key_file", str(tmp_path / "empty")]))


def test_cache_slots_never_exceed_the_context():
    """ContinuousBatch.buffer_for: a power of two >= 512 for short rows, but a row reaching the end of
    an 8192-token window (plus its left padding) gets 8224 slots, not the next power of two (16384)."""
    from msllm.serving.batch import ContinuousBatch

    b = object.__new__(ContinuousBatch)           # buffer_for reads only the generator's context
    b.gen = SimpleNamespace(context=8192)
    assert [b.buffer_for(n) for n in (1, 100, 512, 600, 5000, 8192, 8192 + 31)] == \
        [512, 512, 512, 1024, 8192, 8192, 8224]
    b.gen = SimpleNamespace(context=300)
    assert (b.buffer_for(300), b.buffer_for(331)) == (320, 331)      # a short context: below MIN_BUFFER


def test_requests_the_queue_or_the_scoring_limit_cannot_take_are_400s():
    """A request asking for more choices than the whole queue holds would get a 429 at every retry:
    400 naming ``n``; ``echo`` with ``logprobs`` scores at most ``max_echo_logprobs_tokens`` prompt
    tokens (one pass on the engine thread): 400 naming ``echo`` beyond, nothing queued either way."""
    from starlette.testclient import TestClient

    from msllm.data.tokenizer import load_tokenizer
    from msllm.serving.app import build_app

    eng = FakeEngine()
    eng.queue = queue.Queue(maxsize=4)
    app = build_app(eng, MODEL, load_tokenizer(TOKENIZER), None, 64, None, Limits(max_echo_logprobs_tokens=5))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max_queue" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 2,
                                               "max_tokens": 1}).status_code == 200
        scored = {"model": MODEL, "echo": True, "logprobs": 0, "max_tokens": 0}
        r = c.post("/v1/completions", json=dict(scored, prompt=[1] * 6))
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
        assert c.post("/v1/completions", json=dict(scored, prompt=[1] * 5)).status_code == 200
        assert c.post("/v1/completions", json=dict(scored, prompt=[1] * 6, logprobs=None)).status_code == 200
    assert len(eng.submitted) == 4 + 1 + 1
