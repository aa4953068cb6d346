"""One ``tools/serve.py`` process on the real SmolLM2 for every server test of the session
(test_serving_hostile.py and test_serving_openai.py, one xdist work unit: tests/conftest.py), whose
SIGTERM test stops it: that test runs after all the others, whatever order the files come in."""

from __future__ import annotations

import pytest

from servetest_helpers import GREEDY_PROMPTS, KEY, NEW, predict, start_server


STOPS_THE_SERVER = "test_serving_openai.py::test_sigterm_finishes_requests_in_flight_then_exits_0"


def pytest_collection_modifyitems(items):
    """The test that stops the session's server last (tests/run_parts.sh hands the slowest files
    out first: test_serving_openai.py can come before test_serving_hostile.py)."""
    last = [item for item in items if item.nodeid.endswith(STOPS_THE_SERVER)]
    items[:] = [item for item in items if item not in last] + last


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
