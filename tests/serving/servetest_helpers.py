"""Helpers of the server tests (``tests/serving/conftest.py`` starts one ``tools/serve.py`` process for
the session with :func:`start_server`): a small HTTP client for raw requests, and
:func:`predict`, ``run_msllm.py --run_mode predict``'s outputs for the same prompts (the reference the
server's answers are compared with)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from helpers import REPO
from helpers.distributed import free_port

CONFIG = os.path.join(REPO, "configs", "smollm2", "run_smollm2_135m.yaml")
NEW = 20            # new tokens of the greedy references
# plain-text prompts whose greedy continuations (predict, NEW tokens) both server test modules compare
# with: one predict run for the session (test_serving_openai.py's first three, then
# test_serving_hostile.py's)
GREEDY_PROMPTS = ["The capital of France is", "Water boils at a temperature of", "def fibonacci(n):",
                  "The three primary colors are", "List the days of the week:"]
KEY = "test-key-20261126"
MODEL = "smollm2-test"


class Server:
    """A running ``tools/serve.py``: its process, base URL and log file."""

    def __init__(self, proc, url, log):
        self.proc, self.url, self.log = proc, url, log

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body, key: str | None = KEY, raw: bytes | None = None) -> tuple[int, dict]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


def start_server(model_dir: str, log_path) -> Server:
    """``tools/serve.py`` on the real model, on a free loopback port, with an API key; returns once
    ``/health`` answers (at most 300 s: loading, then the warm-up's compiles)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MS_WORKER_NUM", "RANK_SIZE", "RANK_ID", "MS_ROLE")}
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "serve.py"), "--config", CONFIG,
                             "--load_checkpoint", model_dir, "--port", str(port), "--api_key", KEY,
                             "--model_name", MODEL, "--max_batch", "8", "--max_queue", "16",
                             "--warmup_slots", "1024"],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=dict(env, GLOG_v="3"))
    s = Server(proc, f"http://127.0.0.1:{port}", log_path)
    t = time.time()
    while True:
        try:
            s.health()
            return s
        except OSError:
            assert proc.poll() is None and time.time() - t < 300, log_path.read_text()[-3000:]
            time.sleep(0.5)


def predict(smollm2_dir, tmp_path, records, new: int, template=None, extra=()) -> list[str]:
    """run_msllm.py predict's outputs (``new`` new tokens, greedy unless ``extra`` overrides say
    otherwise) for ``records`` (written as a JSONL file), in order."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(REPO, "run_msllm.py"), "--config", CONFIG, "--run_mode", "predict",
           "--load_checkpoint", smollm2_dir, "--predict_data", str(data), f"--output_dir={out}",
           f"--generation_config.max_new_tokens={new}", "--generation_config.do_sample=False", *extra]
    if template:
        cmd += ["--template", template]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, GLOG_v="3"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "predict" / "predictions.jsonl").read_text().splitlines()]
    return [row["output"] for row in sorted(rows, key=lambda x: x["index"])]
