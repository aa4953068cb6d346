"""The serving engine's continuous batch (msllm/serving/engine.py, msllm/serving/batch.py) in
process, on the real SmolLM2-135M-Instruct: requests that arrive while another is decoding join
its batch between two steps (widening it from 1 row to ``max_batch``, one of them long enough to
widen the cache from 512 slots to 1024: the rows already decoding are copied; the two short ones
prefilled as one group), finish before it, and each gets exactly the greedy tokens that
``Generator.generate`` gives its prompt alone (the static-batch path, which shares no code with
the engine's row bookkeeping)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow

CONFIG = os.path.join(REPO, "configs", "smollm2", "run_smollm2_135m.yaml")
SEED = 0


class Sink:
    """Collects one job's events; ``done`` is set at its last."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.done, self.events = log, name, threading.Event(), []

    def __call__(self, event):
        self.events.append(event)
        if event[0] in ("done", "error"):
            self.log.append(self.name)
            self.done.set()


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    from msllm.config import load_config
    from msllm.generation.chat import load_session
    from msllm.serving.engine import Engine

    cfg = load_config(CONFIG, [f"--load_checkpoint={smollm2_dir}"])
    net, mc, _, tok, _, settings = load_session(cfg)
    eng = Engine(net, mc, tok, settings.eos_token_id, settings.pad_token_id, max_batch=4, window_s=0.01, max_queue=8)
    eng.start()
    yield eng, tok, settings
    eng.stop(60)


def test_requests_join_a_running_batch_and_keep_their_greedy_outputs(engine):
    from msllm.serving.protocol import Job

    eng, tok, settings = engine
    print("seed", SEED, "(greedy decoding: no randomness)")
    long_text = " ".join(["The history of the printing press begins in the fifteenth century."] * 45)
    jobs = {"a": (tok.encode("Once upon a time, in a small village by the sea,"), 48),
            "b": (tok.encode("The three primary colors are"), 10),
            "c": (tok.encode(long_text + " In summary,"), 14),        # 500+ tokens: more slots than a's
            "d": (tok.encode("def fibonacci(n):"), 12)}
    assert len(jobs["c"][0]) > 500
    # each alone, on the static-batch path (one buffer length for all four: one decode graph)
    ref = {k: eng.gen.generate([p], dataclasses.replace(settings, max_new_tokens=n, do_sample=False),
                               buffer=1024).tokens[0] for k, (p, n) in jobs.items()}
    assert len(ref["a"]) == 48                                           # a runs to its length
    before = eng.stats()
    order: list = []
    sinks = {k: Sink(order, k) for k in jobs}
    works = {"a": eng.submit(Job(jobs["a"][0], jobs["a"][1]), sinks["a"])}
    t = time.time()
    while works["a"].tokens is None or len(works["a"].tokens) < 4:      # a is decoding alone
        assert time.time() - t < 300
        time.sleep(0.01)
    buffer_alone, rows_alone = eng.batch.buffer, len(eng.batch.rows)
    for k in "bcd":
        works[k] = eng.submit(Job(jobs[k][0], jobs[k][1]), sinks[k])
    for k in jobs:
        assert sinks[k].done.wait(300), k
    for k in jobs:
        assert works[k].tokens == ref[k], k
        assert sinks[k].events[-1][1] in ("length", "stop")
    assert order[-1] == "a"                                               # the others joined and left first
    after = eng.stats()
    assert after["joined_running"] - before["joined_running"] == 3
    assert after["batches"] - before["batches"] == 1
    assert rows_alone == 1 and buffer_alone == 512                        # a alone: 1 row, 32 + 48 slots -> 512
    assert after["max_batch_seen"] == 4
    assert ("decode", 4, 1, 1024) in eng.gen.first_call_s                # widened to 4 rows, 1024 slots
    assert ("prefill", 2, 32, 32) in eng.gen.first_call_s                # b and d (32 slots each) prefilled together
    t = time.time()
    while eng.stats()["busy"]:
        assert time.time() - t < 60
        time.sleep(0.01)
    assert eng.batch.caches is None and eng.batch.rows == []              # dropped with the last row


def test_a_row_that_fails_fails_alone_and_the_batch_goes_on(engine, monkeypatch):
    """While a greedy request decodes, three requests that fail inside the engine join it: one
    with a seed numpy refuses (-1: ``default_rng`` raises while its row is set up, the issue's
    example), one with an empty prompt (the prefill grouping's division), one whose row raises
    at its 3rd token (an injected failure carrying internal text). Each gets a 500 with the
    generic message and nothing of the internal text; the greedy request still gets exactly its
    reference tokens (its row and the caches were kept), and the engine serves afterwards."""
    from msllm.serving.engine import GENERATION_FAILED
    from msllm.serving.protocol import Job

    eng, tok, settings = engine
    print("seed", SEED, "(greedy decoding for the reference; the failing rows never sample)")
    good = tok.encode("The three primary colors are")
    ref = eng.gen.generate([good], dataclasses.replace(settings, max_new_tokens=24, do_sample=False),
                           buffer=1024).tokens[0]
    poisoned = tok.encode("Once upon a time, in a small village by the sea,")   # runs 48 tokens greedy
    accept = eng.batch._accept

    def failing_accept(b, logits_row):
        r = eng.batch.rows[b]
        if r.work.job.prompt == poisoned and len(r.work.tokens) == 3:
            raise RuntimeError("injected: mindspore internal text CPU kernel xyz")
        return accept(b, logits_row)

    monkeypatch.setattr(eng.batch, "_accept", failing_accept)
    before = eng.stats()
    order: list = []
    sinks = {k: Sink(order, k) for k in ("good", "seed", "empty", "poisoned")}
    g = eng.submit(Job(good, 24), sinks["good"])
    t = time.time()
    while g.tokens is None or len(g.tokens) < 2:
        assert time.time() - t < 300
        time.sleep(0.01)
    eng.submit(Job(tok.encode("Pick a number:"), 8, greedy=False, seed=-1), sinks["seed"])
    eng.submit(Job([], 8), sinks["empty"])
    eng.submit(Job(poisoned, 8), sinks["poisoned"])
    for k in sinks:
        assert sinks[k].done.wait(300), k
    assert g.tokens == ref and sinks["good"].events[-1][0] == "done"
    for k in ("seed", "empty", "poisoned"):
        kind, err = sinks[k].events[-1][:2]
        assert kind == "error" and err.status == 500 and err.message == GENERATION_FAILED, (k, sinks[k].events)
        assert "xyz" not in json.dumps(err.body()) and "ValueError" not in json.dumps(err.body())
    assert [e[0] for e in sinks["poisoned"].events].count("error") == 1
    assert eng.stats()["failed_rows"] - before["failed_rows"] == 3
    assert eng.alive()
    monkeypatch.undo()
    again = Sink([], "again")
    w = eng.submit(Job(good, 24), again)
    assert again.done.wait(300) and w.tokens == ref
