"""msllm.generation.bound_caches: cache sets kept per shape, leased to one user at a time, whose
decode step holds them as graph Parameters (no cache inputs per call).

The model test checks the decode step that holds its caches against the step that takes them as a
``mutable`` tuple (a generator with a zero budget), bit for bit, including a second generation
that reuses the kept set with the first one's keys and values still in it, and a shape whose set
is leased elsewhere (a private cache then).
"""

import numpy as np
import pytest

from gentest_helpers import CASES, net_from_hf_dir
from msllm.errors import MsllmError
from msllm.generation.bound_caches import DEFAULT_MB, ENV, BoundCaches, budget_bytes


def _pool(budget):
    cells = []

    def make_cell(caches):
        cells.append(caches)
        return ("cell", len(cells))

    pool = BoundCaches(lambda rows, slots, name: (name, rows, slots), make_cell,
                       lambda rows, slots: rows * slots, budget)
    return pool, cells


def test_lease_release_budget_and_cells():
    pool, cells = _pool(budget=100)
    a = pool.lease(2, 32)                                   # 64 bytes: kept and leased
    assert a == ("kv_cache_b2_s32_", 2, 32)
    assert pool.lease(2, 32) is None                        # leased already: the caller makes its own
    assert pool.lease(1, 64) is None                        # 64 more would pass 100
    assert pool.lease(1, 32) == ("kv_cache_b1_s32_", 1, 32)  # 32 more fits
    assert pool.kept_bytes == 96
    pool.release(("kv_cache_b2_s32_", 2, 32))               # an equal tuple that is not the set: nothing
    assert pool.lease(2, 32) is None
    pool.release(a)
    assert pool.lease(2, 32) is a                           # the same set again
    assert pool.cell_for(a) == ("cell", 1) and pool.cell_for(a) == ("cell", 1)   # made once
    assert pool.cell_for(("kv_cache_b2_s32_", 2, 32)) is None and cells == [a]


def test_zero_budget_keeps_nothing():
    pool, _ = _pool(budget=0)
    assert pool.lease(1, 1) is None and pool.kept_bytes == 0


@pytest.mark.parametrize("raw,expected", [(None, DEFAULT_MB << 20), ("", DEFAULT_MB << 20), ("0", 0),
                                          ("64", 64 << 20)])
def test_budget_from_environment(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, raw)
    assert budget_bytes() == expected


@pytest.mark.parametrize("raw", ["-1", "1.5", "lots"])
def test_bad_budget_is_one_error(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(MsllmError, match=ENV):
        budget_bytes()


def test_held_caches_decode_as_tuple_inputs_do(tmp_path, monkeypatch):
    from msllm.config_generation import GenerationConfig, resolve_settings
    from msllm.convert.verify import make_random_hf_model
    from msllm.generation.decode import Generator

    kw, fmt, dtype = CASES["gqa_tied_theta5e5"]
    seed = 23
    print("seed", seed)
    make_random_hf_model(str(tmp_path / "hf"), seed=seed, dtype=dtype, fmt=fmt, **kw)
    net, mc, _ = net_from_hf_dir(str(tmp_path / "hf"))
    rng = np.random.default_rng(seed)
    first = [rng.integers(3, kw["vocab_size"], n).tolist() for n in (20, 7)]
    second = [rng.integers(3, kw["vocab_size"], n).tolist() for n in (5, 18)]   # same P and S, other pads
    s = resolve_settings(GenerationConfig(max_new_tokens=12), mc)

    monkeypatch.setenv(ENV, "0")
    plain = Generator(net, mc)                              # every cache private: the tuple-input step
    monkeypatch.delenv(ENV)
    held = Generator(net, mc)
    for prompts in (first, second):                          # the second reuses the first's set, keys and all
        want = plain.generate(prompts, s, keep_logits=True)
        got = held.generate(prompts, s, keep_logits=True)
        assert got.tokens == want.tokens
        assert all(np.array_equal(a, b) for a, b in zip(got.logits, want.logits))
    (entry,) = held.kept.by_shape.values()
    assert not entry.leased                                  # given back after each generation
    assert len(entry.cell.compile_cache) == 1 and len(held.step.compile_cache) == 0
    assert len(plain.step.compile_cache) == 1 and plain.kept.kept_bytes == 0

    # the kept set leased elsewhere: this generation gets a private cache and the tuple-input step
    taken = held.lease_cache(2, entry.caches[0].shape[0] // 2)
    assert taken is entry.caches
    got = held.generate(first, s, keep_logits=True)
    want = plain.generate(first, s, keep_logits=True)
    assert got.tokens == want.tokens and all(np.array_equal(a, b) for a, b in zip(got.logits, want.logits))
    assert len(held.step.compile_cache) == 1 and entry.leased
    held.release_cache(taken)
