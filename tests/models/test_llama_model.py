"""The LLaMA network: parameter names and shapes, causality, GQA, loss masking.

Every test runs on three models: the layout path (``fast_paths=False``: the shapes Ascend and the
parallel layouts use) and the CPU fast path (2-D norm/softmax views, loss over target positions
only) once with msllm's CPU kernels (``cpu_kernels=True``: built first, so a missing build is a
failure, not a silent switch) and once with MindSpore's composed operators (``cpu_kernels=False``,
the documented fallback without a compiler). Each test means the same whether or not
``msllm/kernels/_build`` existed before the run."""

import numpy as np
import pytest

import mindspore as ms

from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.model import LlamaForCausalLM

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)


def small(**kw):
    base = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2,
                intermediate_size=40, seq_length=16, rope_theta=500000.0)
    base.update(kw)
    return LlamaConfig(**base)


PATHS = {"ascend_path": (False, None), "cpu_kernels": (True, True), "cpu_composed": (True, False)}


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    """msllm's CPU kernels built (a no-op when up to date), so ``cpu_kernels=True`` can be asked for."""
    from msllm.kernels import build

    build.build(verbose=False)


@pytest.fixture(scope="module", params=list(PATHS))
def path(request):
    return request.param


@pytest.fixture(scope="module")
def fast(path):
    return PATHS[path][0]


def build_model(path, **kw):
    fast_paths, cpu_kernels = PATHS[path]
    return LlamaForCausalLM(small(cpu_kernels=cpu_kernels, **kw), fast_paths=fast_paths)


@pytest.fixture(scope="module")
def model(path):
    ms.set_seed(1)
    return build_model(path)


@pytest.mark.parametrize("fast_path", ["cpu_kernels", "cpu_composed"])
def test_both_paths_compute_the_same_function(fast_path):
    from msllm.kernels.select import COMPOSED, CPU_FLASH, CPU_NORM

    ms.set_seed(3)
    a = build_model("ascend_path")
    b = build_model(fast_path)
    ms.load_param_into_net(b, {p.name: p for p in a.trainable_params()})
    assert a.compact_loss is False and b.compact_loss is True and b.model.norm.flat
    kernels = fast_path == "cpu_kernels"
    assert (b.kernels.cpu is not None) == kernels
    assert (b.kernels.attention, b.kernels.norm) == ((CPU_FLASH, CPU_NORM) if kernels else (COMPOSED, COMPOSED))
    rng = np.random.default_rng(4)
    ids = rng.integers(3, 97, (2, 9)).astype(np.int32)
    labels = ids.copy()
    labels[:, :3] = -100
    np.testing.assert_allclose(a(ms.Tensor(ids)).asnumpy(), b(ms.Tensor(ids)).asnumpy(), atol=2e-6)
    la, lb = (float(m(ms.Tensor(ids), ms.Tensor(labels)).asnumpy()) for m in (a, b))
    # float32 rounding only: the fast path may run msllm's CPU kernels (other summation orders and
    # exp/log), which moves the loss by a few ulp (observed 4e-7 relative)
    assert abs(la - lb) <= 1e-6 * abs(la)


def test_parameter_count_and_names(model):
    cfg = small()
    params = {p.name: tuple(p.shape) for p in model.trainable_params()}
    assert sum(int(np.prod(s)) for s in params.values()) == cfg.num_params()
    assert params["model.embed_tokens.embedding_table"] == (97, 32)
    assert params["model.layers.1.self_attn.k_proj.weight"] == (2 * 8, 32)  # kv heads x head_dim
    assert params["model.layers.0.mlp.down_proj.weight"] == (32, 40)
    assert params["lm_head.weight"] == (97, 32)


def test_logits_shape_and_dtype(model):
    ids = ms.Tensor(np.arange(10, dtype=np.int32).reshape(2, 5))
    logits = model(ids)
    assert logits.shape == (2, 5, 97) and logits.dtype == ms.float32


def test_causal_mask_later_tokens_do_not_change_earlier_logits(model):
    rng = np.random.default_rng(0)
    a = rng.integers(3, 97, (1, 12)).astype(np.int32)
    b = a.copy()
    b[0, 7:] = rng.integers(3, 97, 5)
    la = model(ms.Tensor(a)).asnumpy()
    lb = model(ms.Tensor(b)).asnumpy()
    np.testing.assert_allclose(la[0, :7], lb[0, :7], atol=1e-6)
    assert np.abs(la[0, 7:] - lb[0, 7:]).max() > 1e-4  # and the later ones do change


def test_loss_ignores_masked_targets_and_matches_numpy(model):
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 97, (2, 9)).astype(np.int32)
    labels = ids.copy()
    labels[:, :4] = -100
    loss = float(model(ms.Tensor(ids), ms.Tensor(labels)).asnumpy())
    logits = model(ms.Tensor(ids[:, :-1])).asnumpy().astype(np.float64)
    tgt = labels[:, 1:]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    keep = tgt != -100
    ref = -logp[keep, tgt[keep]].mean()
    assert abs(loss - ref) < 1e-5
    # a batch whose targets are all ignored gives 0, not NaN
    none = np.full_like(labels, -100)
    assert float(model(ms.Tensor(ids), ms.Tensor(none)).asnumpy()) == 0.0


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads(path):
    ms.set_seed(2)
    gqa = build_model(path, n_kv_heads=2)
    mha = build_model(path, n_kv_heads=4)
    d = 8
    src = {p.name: p.asnumpy() for p in gqa.trainable_params()}
    for p in mha.trainable_params():
        w = src[p.name]
        if p.name.endswith(("k_proj.weight", "v_proj.weight")):
            w = np.repeat(w.reshape(2, d, 32), 2, axis=0).reshape(4 * d, 32)  # head h uses kv h // 2
        p.set_data(ms.Tensor(w))
    ids = ms.Tensor(np.arange(3, 14, dtype=np.int32)[None])
    np.testing.assert_allclose(gqa(ids).asnumpy(), mha(ids).asnumpy(), atol=1e-5)


def test_tied_embeddings_share_the_table(path):
    m = build_model(path, tie_word_embeddings=True)
    names = [p.name for p in m.trainable_params()]
    assert "lm_head.weight" not in names
    assert sum(p.size for p in m.trainable_params()) == small(tie_word_embeddings=True).num_params()
    assert m(ms.Tensor(np.array([[1, 2, 3]], np.int32))).shape == (1, 3, 97)
