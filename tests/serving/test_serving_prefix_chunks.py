"""The serving engine's prefix cache and chunked prefill (msllm/serving/joining.py,
prefix_cache.py, staged_prefill.py) in process, on the real SmolLM2-135M-Instruct:

* prefix cache: prompts sharing a long system text, and a second turn that repeats the first turn's
  prompt and reply, give token for token the same greedy outputs with the cache on (they reuse the
  cached blocks: hits counted, the suffix computed by the (1, 32, 512) piece graph) as with it off;
* chunked prefill: a 600-token prompt joining a decoding row is prefilled in 128-token pieces
  between that row's decode steps (the row makes tokens while the long prompt is being prefilled),
  and both get exactly the greedy tokens ``Generator.generate`` gives each prompt alone (the
  static path: one whole prefill);
* warm-up: the engine is warmed up before it starts (``Engine.warmup(1024)``), and the chunks'
  shape then runs without compiling again (each call well under the warm-up's first call)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from helpers import REPO

pytestmark = pytest.mark.slow

CONFIG = os.path.join(REPO, "configs", "smollm2", "run_smollm2_135m.yaml")
SEED = 0
CHUNK = 128


class Sink:
    """One job's events with their ``time.monotonic()``; ``done`` set at the last."""

    def __init__(self):
        self.events, self.times, self.done = [], [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        self.times.append(time.monotonic())
        if event[0] in ("done", "error"):
            self.done.set()


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    from msllm.config import load_config
    from msllm.generation.chat import load_session
    from msllm.serving.engine import Engine

    cfg = load_config(CONFIG, [f"--load_checkpoint={smollm2_dir}"])
    net, mc, _, tok, _, settings = load_session(cfg)
    eng = Engine(net, mc, tok, settings.eos_token_id, settings.pad_token_id, max_batch=4, window_s=0.01,
                 max_queue=8, prefix_cache_bytes=256 << 20, prefill_chunk_size=CHUNK)
    warmed = dict(eng.warmup(1024))
    for shape in [("decode", 4, 1, 1024), ("extend", 1, 32, 512), ("extend", 1, CHUNK, 512),
                  ("extend", 1, CHUNK, 1024)]:
        assert shape in warmed, (shape, warmed)
    eng.start()
    yield eng, tok, settings
    eng.stop(60)


@pytest.fixture
def calls(engine, monkeypatch):
    """[(kind, rows, tokens, slots, seconds)] of the engine's model calls during the test."""
    gen, out = engine[0].gen, []
    real = gen.run

    def timed(kind, ids, positions, kpos, *rest, **kw):
        t0 = time.perf_counter()
        r = real(kind, ids, positions, kpos, *rest, **kw)
        out.append((kind, ids.shape[0], ids.shape[1], kpos.shape[-1], time.perf_counter() - t0))
        return r

    monkeypatch.setattr(gen, "run", timed)
    return out


def run(eng, prompt, n):
    from msllm.serving.protocol import Job

    sink = Sink()
    w = eng.submit(Job(list(prompt), n), sink)
    assert sink.done.wait(600)
    assert sink.events[-1][0] == "done", sink.events[-1]
    return w.tokens


def test_prefix_cache_greedy_outputs_are_identical_with_and_without(engine, calls):
    eng, tok, _ = engine
    print("seed", SEED, "(greedy decoding: no randomness)")
    system = " ".join(["You are a careful assistant who answers questions about European history."] * 12)
    turns = [system + " Question: " + q + " Answer:" for q in
             ("What is the capital of France?", "Who wrote Hamlet?", "When did the Roman Empire fall?")]
    prompts = [tok.encode(t) for t in turns]
    assert min(len(p) for p in prompts) > 140
    eng.batch.chunk = 0                       # these prompts exceed CHUNK: no chunking, the prefix cache alone
    eng.batch.prefix = None                                     # off: every prompt prefilled whole
    off = [run(eng, p, 20) for p in prompts]
    second = prompts[0] + off[0] + tok.encode(" Question: And of Spain? Answer:")   # a second turn
    off.append(run(eng, second, 20))
    assert not [c for c in calls if c[0] == "extend"]         # off: no piece ran
    eng.batch.prefix = eng.prefix_cache                         # on
    store = eng.prefix_cache
    q0, h0 = store.queried, store.hit
    hits0 = eng.metrics.registry.get_sample_value("msllm:prefix_cache_hits_total")
    on = [run(eng, p, 20) for p in prompts]
    on.append(run(eng, second, 20))
    on_again = [run(eng, p, 20) for p in prompts + [second]]    # every prompt now stored
    assert on == off and on_again == off
    assert all(len(t) > 0 for t in off)
    shared = len(tok.encode(system)) // 32 * 32 - 32           # whole blocks surely inside the system text
    assert store.hit - h0 >= 3 * shared + 4 * shared            # prompts 2, 3 and the second turn, then all four
    assert store.queried - q0 == 2 * sum(len(p) for p in prompts + [second])
    assert eng.metrics.registry.get_sample_value("msllm:prefix_cache_hits_total") - hits0 == store.hit - h0
    assert [c for c in calls if c[:4] == ("extend", 1, 32, 512)]   # a suffix piece over the cached prefix
    eng.batch.chunk = CHUNK


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(engine, calls):
    from msllm.serving.protocol import Job
    from msllm.serving.staged_prefill import piece_layout

    eng, tok, settings = engine
    print("seed", SEED, "(greedy decoding: no randomness)")
    eng.batch.prefix = None
    short = tok.encode("Once upon a time, in a small village by the sea,")
    long_text = " ".join(["The history of the printing press begins in the fifteenth century."] * 50)
    long = tok.encode(long_text + " In summary,")
    assert 560 < len(long) < 640
    e, q, _, _, slots = piece_layout(len(long), 0, CHUNK)
    assert (e, q, slots) == (CHUNK, 5, 1024)
    s = dataclasses.replace(settings, do_sample=False)
    ref_short = eng.gen.generate([short], dataclasses.replace(s, max_new_tokens=48), buffer=1024).tokens[0]
    ref_long = eng.gen.generate([long], dataclasses.replace(s, max_new_tokens=12), buffer=1024).tokens[0]
    a, c = Sink(), Sink()
    wa = eng.submit(Job(short, 48), a)
    t = time.time()
    while wa.tokens is None or len(wa.tokens) < 4:              # the short one is decoding alone
        assert time.time() - t < 300
        time.sleep(0.01)
    t_join = time.monotonic()
    wc = eng.submit(Job(long, 12), c)
    assert a.done.wait(600) and c.done.wait(600)
    assert wa.tokens == ref_short and wc.tokens == ref_long
    t_first = c.times[0]                                        # the long prompt's first text
    between = sum(1 for ev, tm in zip(a.events, a.times) if ev[0] == "text" and t_join < tm < t_first)
    # the short row made a token after each of the first q - 1 pieces (text can be held back a
    # step by the stop-string check, hence q - 2)
    assert between >= q - 2, between
    chunks = [c[4] for c in calls if c[:4] == ("extend", 1, CHUNK, 1024)]
    assert len(chunks) == q
    print("chunk seconds", chunks, "warm-up's first call", eng.gen.first_call_s[("extend", 1, CHUNK, 1024)])
    assert max(chunks) < eng.gen.first_call_s[("extend", 1, CHUNK, 1024)] / 3     # warmed: no compile


def test_pieces_give_the_whole_prefills_logits_and_cache(engine):
    """A 600-token prompt in 128-token pieces (StagedPrefill: ``decode_attention`` with the
    queries blocked over the cache) against one whole prefill (the flash kernel) into a fresh
    cache: the last token's logits and every prompt slot's keys and values agree within 1e-4
    (float32 sums in another order; SmolLM2's logits are O(10), the measured difference is
    printed). The piece graph runs in this thread while the engine's thread waits for work."""
    from msllm.generation.passes import round_up
    from msllm.serving.staged_prefill import StagedPrefill, read_slots

    eng, tok, settings = engine
    print("seed", SEED, "(no randomness: one prompt, forward only)")
    long = tok.encode(" ".join(["The history of the printing press begins in the fifteenth century."] * 50))
    n, pad_id = len(long), settings.pad_token_id
    logits, caches, pads = eng.gen.prefill([long], round_up(n), 1024, pad_id)
    whole_kv = read_slots(caches, 1, 0, int(pads[0]), int(pads[0]) + n)             # (60, n, K, D)
    pf = StagedPrefill(eng.gen, long, 0, None, CHUNK, pad_id, eng.gen.empty_cache(1, 1024))
    while not pf.done:
        pf.step()
    piece_kv = pf.prompt_kv(0, n)
    dl, dkv = float(np.abs(pf.logits - logits[0]).max()), float(np.abs(piece_kv - whole_kv).max())
    print(f"{pf.q} pieces of {pf.e}: max |logits diff| {dl:.2e} (max |logit| {np.abs(logits).max():.1f}), "
          f"max |k/v diff| {dkv:.2e}")
    assert pf.q == 5 and dl < 1e-4 and dkv < 1e-4
    assert int(np.argmax(pf.logits)) == int(np.argmax(logits[0]))
