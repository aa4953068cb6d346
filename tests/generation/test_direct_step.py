"""msllm.generation.direct_step: the CPU decode step through msllm's kernels called on the model's buffers.

Each case generates with the direct step and with every step through MindSpore's compiled graph
(``MSLLM_DIRECT_DECODE=0``), from the same weights: the tokens and every step's logits must be equal bit for
bit, and the direct step must have served the steps after each shape's first (the one checked against the
graph). Cases: float32 with tied and untied heads, bfloat16 weights (the table's lookup and the final norm's
widening), weight-only int8, bfloat16 compute (the head's bfloat16-math product), a sliding window, rotary
scaling with an attention factor (YaRN), left-padded rows of different lengths, and the serving batch's rows
each at its own slot. Then: a step whose first-call check fails hands every later step to the graph with
the same outputs; reloaded weights are picked up; a decode graph of another shape is declined with a reason.
"""

import numpy as np
import pytest

from gentest_helpers import CASES
from msllm.generation.direct_step import ENV, DirectDecode

SEED = 31


def _net(tmp_path, kw, dtype="float32", overrides=None):
    from msllm.config import RunConfig
    from msllm.convert.verify import make_random_hf_model
    from msllm.generation.loading import load_for_inference

    print("seed", SEED)
    make_random_hf_model(str(tmp_path / "hf"), seed=SEED, dtype=dtype, fmt="safetensors", **kw)
    cfg = RunConfig()
    for key, value in (overrides or {}).items():
        setattr(cfg.model.model_config, key, value)
    net, mc, _ = load_for_inference(cfg, str(tmp_path / "hf"))
    return net, mc


def _pair(net, mc, monkeypatch):
    """(direct, graph): two generators of ``net``, the second with every step through the graph."""
    from msllm.generation.decode import Generator

    monkeypatch.setenv(ENV, "0")
    graph = Generator(net, mc)
    monkeypatch.delenv(ENV)
    direct = Generator(net, mc)
    assert graph.direct is None
    assert direct.direct is not None, DirectDecode.unsupported(net)
    return direct, graph


def _prompts(vocab, lengths):
    rng = np.random.default_rng(SEED)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _same_generation(direct, graph, mc, prompts, new=10):
    from msllm.config_generation import GenerationConfig, resolve_settings

    s = resolve_settings(GenerationConfig(max_new_tokens=new), mc)
    want = graph.generate(prompts, s, keep_logits=True)
    got = direct.generate(prompts, s, keep_logits=True)
    assert got.tokens == want.tokens
    assert len(got.logits) == len(want.logits) == new
    for k, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert np.array_equal(a, b), f"step {k}: max |diff| {np.abs(a - b).max()}"
    d = direct.direct
    assert d.failed is None and d.prepared and all(p.verified for p in d.prepared.values())
    return got


_KW = CASES["gqa_tied_theta5e5"][0]
_UNTIED = dict(_KW, tie_word_embeddings=False)
_YARN = dict(_UNTIED, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})


@pytest.mark.parametrize("kw,dtype,overrides", [
    (_KW, "float32", {}),
    (_UNTIED, "float32", {}),
    (_KW, "bfloat16", {"param_init_type": "bfloat16"}),
    (_UNTIED, "float32", {"param_init_type": "int8"}),
    (_KW, "float32", {"param_init_type": "int8"}),
    (_KW, "float32", {"compute_dtype": "bfloat16"}),
    (CASES["mistral_window16"][0], "float32", {}),
    (_YARN, "float32", {}),
], ids=["f32_tied", "f32_untied", "bf16", "int8_untied", "int8_tied", "bf16_compute", "window16", "yarn"])
def test_direct_step_gives_the_graph_s_bits(tmp_path, monkeypatch, kw, dtype, overrides):
    net, mc = _net(tmp_path, kw, dtype, overrides)
    if overrides.get("param_init_type") == "int8":
        assert net.lm_head is not None and net.lm_head.int8
    direct, graph = _pair(net, mc, monkeypatch)
    if "sliding_window" in kw:
        assert direct.direct.window == kw["sliding_window"]
    if "rope_scaling" in kw:                                  # YaRN's attention factor scales cos and sin
        assert direct.direct.rope_factor != 1.0
    if overrides.get("compute_dtype") == "bfloat16":
        assert direct.direct.head_kernel == "msllm_linear_bf16math"
    _same_generation(direct, graph, mc, _prompts(kw["vocab_size"], (9, 30, 1)), new=24)   # past the window
    assert direct.direct.steps >= 12


def test_serving_rows_each_at_its_own_slot(tmp_path, monkeypatch):
    """The engine's continuous batch: per-row slots (B, 1), a row's positions its own; and an empty row."""
    from msllm.models.llama.batch_layout import key_positions, left_pad, positions_for

    net, mc = _net(tmp_path, _KW)
    direct, graph = _pair(net, mc, monkeypatch)
    prompts = _prompts(_KW["vocab_size"], (5, 12, 3))
    buffer = 32
    out = {}
    for name, gen in (("direct", direct), ("graph", graph)):
        caches = gen.lease_cache(3, buffer)
        ids, pads = left_pad(prompts, 12, 0)
        gen.run("prefill", ids, positions_for(pads, np.arange(12)), key_positions(pads, buffer), np.arange(12), caches)
        pads = np.array([7, 0, -1])                              # row 2 empty: every slot hidden
        slots = np.array([12, 12, 12])
        steps = []
        tok = np.array([[4], [5], [6]], np.int32)
        for k in range(4):
            logits, _ = gen.run("decode", tok, positions_for(pads, slots[:, None]), key_positions(pads, buffer),
                                slots[:, None], caches)
            steps.append(logits.copy())
            tok = logits.argmax(-1).astype(np.int32)[:, None]
            slots = slots + np.array([1, 1, 0])                 # row 2 stays where it is
        gen.release_cache(caches)
        out[name] = steps
    for a, b in zip(out["direct"], out["graph"]):
        assert np.array_equal(a, b)
    assert direct.direct.steps == 3


def test_a_failed_check_hands_every_step_to_the_graph(tmp_path, monkeypatch, caplog):
    net, mc = _net(tmp_path, _KW)
    direct, graph = _pair(net, mc, monkeypatch)
    real_fill = DirectDecode.fill

    def off_by_one(self, pre, ids, positions, kpos, index):   # a host input made wrongly
        real_fill(self, pre, ids, positions + 1, kpos, index)

    monkeypatch.setattr(DirectDecode, "fill", off_by_one)
    prompts = _prompts(_KW["vocab_size"], (6, 11))
    with caplog.at_level("WARNING", logger="msllm"):
        from msllm.config_generation import GenerationConfig, resolve_settings

        s = resolve_settings(GenerationConfig(max_new_tokens=8), mc)
        want = graph.generate(prompts, s, keep_logits=True)
        got = direct.generate(prompts, s, keep_logits=True)
    assert got.tokens == want.tokens and all(np.array_equal(a, b) for a, b in zip(got.logits, want.logits))
    assert direct.direct.failed is not None and "differ" in direct.direct.failed and direct.direct.steps == 0
    assert "direct decode step off" in caplog.text


def test_reloaded_weights_are_read_again(tmp_path, monkeypatch):
    import mindspore as ms

    net, mc = _net(tmp_path, _UNTIED)
    direct, graph = _pair(net, mc, monkeypatch)
    prompts = _prompts(_KW["vocab_size"], (8,))
    first = _same_generation(direct, graph, mc, prompts)
    w = net.lm_head.weight
    rng = np.random.default_rng(SEED)
    w.set_data(ms.Tensor(rng.standard_normal(w.shape).astype(np.float32)))    # a reload: new values
    second = _same_generation(direct, graph, mc, prompts)
    assert second.tokens != first.tokens


def test_other_graph_shapes_are_declined(tmp_path, monkeypatch, caplog):
    net, _ = _net(tmp_path, CASES["gemma_geglu_mqa"][0])              # GeGLU, an embedding multiplier
    assert DirectDecode.unsupported(net) is not None
    with caplog.at_level("INFO", logger="msllm"):
        assert DirectDecode.build(net) is None
    assert "the direct step does not apply" in caplog.text
    caplog.clear()
    monkeypatch.setenv(ENV, "0")
    net, _ = _net(tmp_path / "llama", _KW)
    with caplog.at_level("INFO", logger="msllm"):
        assert DirectDecode.unsupported(net) is None and DirectDecode.build(net) is None
    assert f"graph launch ({ENV}=0)" in caplog.text                   # switched off, and the log says so
