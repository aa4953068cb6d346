"""Numerical check of the tensor-parallel layout in one process: each rank's shards (the files
mindspore.transform_checkpoints wrote from msllm's strategy) run the layer forward in numpy,
partial results are combined as the collectives would (AllGather of optimizer shards, concat of
column-parallel outputs, sum of row-parallel partial outputs), and the result must match the
unsharded msllm DecoderLayer."""

import numpy as np
from helpers.tables import training_tables
import pytest

from msllm.config import ParallelLayoutConfig
from msllm.models.llama.config import preset
from msllm.parallel.param_layout import param_layouts
from msllm.parallel.reshard import transform_checkpoints
from msllm.parallel.reshard_inputs import collect_rank_checkpoints
from msllm.parallel.strategy import write_strategy_files

MC = preset("tiny")                      # 4 query heads sharing 2 key/value heads (GQA)
LAYOUT = ParallelLayoutConfig(data_parallel=2, model_parallel=2, optimizer_shard=True, vocab_emb_dp=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    from msllm.models.llama.model import LlamaForCausalLM

    d = tmp_path_factory.mktemp("numerics")
    ms.set_seed(7)
    net = LlamaForCausalLM(MC)
    rng = np.random.default_rng(7)
    for p in net.get_parameters():          # non-trivial norm weights too
        if "norm" in p.name:
            p.set_data(ms.Tensor((1.0 + 0.1 * rng.standard_normal(p.shape)).astype(np.float32)))
    (d / "full" / "rank_0").mkdir(parents=True)
    ms.save_checkpoint(net, str(d / "full" / "rank_0" / "full.ckpt"))
    write_strategy_files(MC, LAYOUT, str(d / "strategy"))
    transform_checkpoints(str(d / "full"), str(d / "sharded"), None, str(d / "strategy"))
    shards = {r: {k: v.asnumpy().astype(np.float64) for k, v in ms.load_checkpoint(p).items()}
              for r, p in collect_rank_checkpoints(str(d / "sharded")).items()}
    return net, shards


def gathered(shards, name, dp, mp, d, m, lays):
    """Rank (d, m)'s model-parallel slice: its optimizer shards all-gathered over the dp group."""
    if lays[name].opt_shard_size == 0:
        return shards[d * mp + m][name]
    return np.concatenate([shards[dd * mp + m][name] for dd in range(dp)], axis=0)


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def layer_on_rank(x, w, cos, sin, mask, heads, kv_heads, head_dim, eps):
    """One decoder layer on one tensor-parallel rank, up to the row-parallel partial sums.
    x (b, T, C) replicated over mp; returns (attention partial (b, T, C), function of h -> MLP partial)."""
    b, t, c = x.shape
    xn = rms(x, w["input_layernorm.weight"], eps).reshape(b * t, c)
    q = (xn @ w["self_attn.q_proj.weight"].T).reshape(b, t, heads, head_dim).transpose(0, 2, 1, 3)
    k = (xn @ w["self_attn.k_proj.weight"].T).reshape(b, t, kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = (xn @ w["self_attn.v_proj.weight"].T).reshape(b, t, kv_heads, head_dim).transpose(0, 2, 1, 3)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    rep = heads // kv_heads
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    p = softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim) + mask)
    out = (p @ v).transpose(0, 2, 1, 3).reshape(b * t, heads * head_dim)
    attn_partial = (out @ w["self_attn.o_proj.weight"].T).reshape(b, t, c)

    def mlp_partial(h):
        hn = rms(h, w["post_attention_layernorm.weight"], eps).reshape(b * t, c)
        g = hn @ w["mlp.gate_proj.weight"].T
        u = hn @ w["mlp.up_proj.weight"].T
        act = g / (1.0 + np.exp(-g)) * u
        return (act @ w["mlp.down_proj.weight"].T).reshape(b, t, c)

    return attn_partial, mlp_partial


@pytest.mark.parametrize("layer_index", [0, 3])
def test_tensor_parallel_decoder_layer_matches_unsharded(setup, layer_index):
    import mindspore as ms

    net, shards = setup
    dp, mp = LAYOUT.data_parallel, LAYOUT.model_parallel
    lays = param_layouts(MC, LAYOUT)
    batch, t = 4, 12
    x = np.random.default_rng(layer_index).standard_normal((batch, t, MC.hidden_size)).astype(np.float32)
    cos, sin, mask = training_tables(MC, t)
    ref = net.model.layers[layer_index](ms.Tensor(x), cos, sin, mask).asnumpy()

    prefix = f"model.layers.{layer_index}."
    names = [n for n in lays if n.startswith(prefix) and not n.startswith("adam")]
    out = np.zeros_like(ref, dtype=np.float64)
    rows = batch // dp
    for d in range(dp):                                  # data parallel: each dp rank its batch rows
        xd = x[d * rows:(d + 1) * rows].astype(np.float64)
        funcs, attn_sum = [], 0.0
        for m in range(mp):
            w = {n[len(prefix):]: gathered(shards, n, dp, mp, d, m, lays) for n in names}
            assert w["self_attn.q_proj.weight"].shape == (MC.hidden_size // mp, MC.hidden_size)
            assert w["self_attn.k_proj.weight"].shape == (MC.kv_heads * MC.head_dim // mp, MC.hidden_size)
            assert w["mlp.down_proj.weight"].shape == (MC.hidden_size, MC.ffn_size // mp)
            partial, mlp = layer_on_rank(xd, w, cos.asnumpy(), sin.asnumpy(), mask.asnumpy(), MC.num_heads // mp,
                                         MC.kv_heads // mp, MC.head_dim, MC.rms_norm_eps)
            attn_sum = attn_sum + partial                # AllReduce(sum) of the row-parallel o_proj
            funcs.append(mlp)
        h = xd + attn_sum
        out[d * rows:(d + 1) * rows] = h + sum(f(h) for f in funcs)   # AllReduce of down_proj
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    # and a single rank alone is not the answer (the combination matters)
    assert np.abs(out - ref).max() < 1e-5 < np.abs(ref).max()


def test_vocab_parallel_embedding_and_head_match_unsharded(setup):
    import mindspore as ms

    net, shards = setup
    dp, mp = LAYOUT.data_parallel, LAYOUT.model_parallel
    lays = param_layouts(MC, LAYOUT)
    v = MC.vocab_size
    ids = np.random.default_rng(1).integers(0, v, (4, 9))
    full_emb = net.model.embed_tokens(ms.Tensor(ids, ms.int32)).asnumpy()
    h = np.random.default_rng(2).standard_normal((36, MC.hidden_size))
    full_logits = h @ net.lm_head.weight.asnumpy().astype(np.float64).T
    for d in range(dp):
        emb = 0.0
        logits = []
        for m in range(mp):
            table = gathered(shards, "model.embed_tokens.embedding_table", dp, mp, d, m, lays)
            assert table.shape == (v // mp, MC.hidden_size)
            lo = m * v // mp
            local = ids - lo
            inside = (local >= 0) & (local < v // mp)
            emb = emb + np.where(inside[..., None], table[np.clip(local, 0, v // mp - 1)], 0.0)   # AllReduce
            logits.append(h @ gathered(shards, "lm_head.weight", dp, mp, d, m, lays).T)
        np.testing.assert_allclose(emb, full_emb, atol=1e-7)
        np.testing.assert_allclose(np.concatenate(logits, axis=1), full_logits, atol=1e-10)  # AllGather on V
