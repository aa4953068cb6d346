"""One ``tools/serve.py`` process on the real SmolLM2 for every server test of the session
(test_serving_hostile.py, then test_serving_openai.py, whose last test stops it with SIGTERM)."""

from __future__ import annotations

import pytest

from servetest_helpers import GREEDY_PROMPTS, KEY, NEW, predict, start_server


@pytest.fixture(scope="session")
def server(smollm2_dir, tmp_path_factory):
    s = start_server(smollm2_dir, tmp_path_factory.mktemp("serve") / "serve.log")
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait(30)


@pytest.fixture(scope="session")
def greedy_predictions(smollm2_dir, tmp_path_factory) -> dict:
    """{prompt: run_msllm.py predict's greedy output of NEW tokens} for GREEDY_PROMPTS (plain text)."""
    out = predict(smollm2_dir, tmp_path_factory.mktemp("greedy"), [{"prompt": p} for p in GREEDY_PROMPTS], NEW,
                  template="none")
    return dict(zip(GREEDY_PROMPTS, out))


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
