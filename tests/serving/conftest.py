"""One ``tools/serve.py`` process on the real SmolLM2 for every server test of the session
(test_serving_hostile.py, then test_serving_openai.py, whose last test stops it with SIGTERM)."""

from __future__ import annotations

import pytest

from servetest_helpers import KEY, start_server


@pytest.fixture(scope="session")
def server(smollm2_dir, tmp_path_factory):
    s = start_server(smollm2_dir, tmp_path_factory.mktemp("serve") / "serve.log")
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait(30)


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
