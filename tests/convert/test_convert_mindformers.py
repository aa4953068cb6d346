"""MindFormers-named LLaMA checkpoints: names map both ways; a checkpoint written the way
MindFormers 1.9.0 writes it (``convert_pt_to_ms`` names, then ``convert_qkv_concat_weight``'s
Megatron row order, with optimizer moments and counters) loads into msllm for prediction and for
training (moments too) bit-exactly, and exports to HF with transformers parity; MHA and GQA.

The reference layout below is written from MindFormers' own code, not from msllm's:
``qkv_concat_hf2mg`` / ``ffn_concat_hf2mg`` in ``mindformers/utils/convert_utils.py`` and
``convert_qkv_concat_weight`` in ``mindformers/models/llama/convert_weight.py``
(mindspore-lab/mindformers commit 6ffdebbf16f78324c6b7d4e6a936dd53ebf13b93).
"""

import numpy as np
import pytest

import mindspore as ms

from msllm.convert import hf
from msllm.convert.verify import check_parity, make_random_hf_model, sentence_ids
from msllm.errors import MsllmError
from msllm.formats.mindformers import (fuse_gate_up, fuse_qkv, split_gate_up, split_qkv, to_msllm_names)
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.names import (is_mindformers_name, mindformers_to_msllm_name, msllm_to_mindformers_name,
                                      param_shapes)
from msllm.training import checkpoint as ckpt

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)

# GQA with 6 query / 2 kv heads (the shape of the issue), and MHA
SHAPES = {"gqa_6q_2kv": dict(vocab_size=128, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64),
          "mha_4": dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)}


# --------------------------------------------------------------------------- MindFormers' reference


def mf_qkv_concat_hf2mg(qkv, num_heads, n_kv_heads, hidden_size):
    """MindFormers ``qkv_concat_hf2mg`` (convert_utils.py), same steps, numpy."""
    w, h = qkv.shape
    n_rep = num_heads // n_kv_heads
    q_channel, kv_channel = hidden_size, hidden_size // n_rep
    q = qkv[:q_channel].reshape(n_kv_heads, hidden_size // n_kv_heads, -1)
    k = qkv[q_channel:q_channel + kv_channel].reshape(n_kv_heads, hidden_size // num_heads, -1)
    v = qkv[q_channel + kv_channel:q_channel + 2 * kv_channel].reshape(n_kv_heads, hidden_size // num_heads, -1)
    return np.concatenate((q, k, v), axis=1).reshape(w, h)


def mf_ffn_concat_hf2mg(ffn, ffn_hidden_size):
    """MindFormers ``ffn_concat_hf2mg`` (convert_utils.py), same steps, numpy."""
    w, h = ffn.shape
    gate = ffn[: w // 2].reshape(ffn_hidden_size, 1, -1)
    hidden = ffn[w // 2: w // 2 * 2].reshape(ffn_hidden_size, 1, -1)
    return np.concatenate((gate, hidden), axis=1).reshape(w, h)


def mf_name_replace(name):
    """MindFormers ``name_replace`` of ``convert_weight.py`` (HF -> MindFormers)."""
    for a, b in (("embed_tokens.weight", "tok_embeddings.embedding_weight"), (".self_attn.q_proj.", ".attention.wq."),
                 (".self_attn.k_proj.", ".attention.wk."), (".self_attn.v_proj.", ".attention.wv."),
                 (".self_attn.o_proj.", ".attention.wo."), (".mlp.gate_proj.", ".feed_forward.w1."),
                 (".mlp.down_proj.", ".feed_forward.w2."), (".mlp.up_proj.", ".feed_forward.w3."),
                 (".input_layernorm.", ".attention_norm."), (".post_attention_layernorm.", ".ffn_norm."),
                 (".norm.", ".norm_out.")):
        name = name.replace(a, b)
    return name


def mf_convert_qkv_concat_weight(params, num_heads, n_kv_heads, hidden_size, ffn_hidden_size, prefix=""):
    """MindFormers ``convert_qkv_concat_weight`` (llama convert_weight.py) on a {name: array} dict."""
    for i in range(500):
        a = f"{prefix}model.layers.{i}.attention."
        if a + "wq.weight" not in params:
            break
        qkv = np.concatenate([params.pop(a + f"w{x}.weight") for x in "qkv"], 0)
        params[a + "w_qkv.weight"] = mf_qkv_concat_hf2mg(qkv, num_heads, n_kv_heads, hidden_size)
        f = f"{prefix}model.layers.{i}.feed_forward."
        gh = np.concatenate([params.pop(f + "w1.weight"), params.pop(f + "w3.weight")], 0)
        params[f + "w_gate_hidden.weight"] = mf_ffn_concat_hf2mg(gh, ffn_hidden_size)
    return params


def write_mindformers_checkpoint(hf_model, path, qkv_concat=True, seed=0):
    """What MindFormers' trainer would save after loading ``convert_pt_to_ms`` +
    ``convert_qkv_concat_weight`` output: weights, AdamW moments (random, so a wrong split of
    them shows), global_step and scale_sense. Returns ({HF name: weight}, {MindFormers name: moment})."""
    c = hf_model.config
    hf_w = {n: t.detach().numpy().copy() for n, t in hf_model.state_dict().items() if "rotary" not in n}
    named = {mf_name_replace(n): v for n, v in hf_w.items()}
    rng = np.random.default_rng(seed)
    print(f"moments seed {seed}")
    moments = {f"{m}.{n}": rng.standard_normal(v.shape).astype(np.float32)
               for m in ("adam_m", "adam_v") for n, v in named.items()}
    if qkv_concat:
        args = (c.num_attention_heads, c.num_key_value_heads, c.hidden_size, c.intermediate_size)
        named = mf_convert_qkv_concat_weight(named, *args)
        for m in ("adam_m.", "adam_v."):
            moments = mf_convert_qkv_concat_weight(moments, *args, prefix=m)
    entries = [{"name": n, "data": ms.Tensor(v)} for n, v in {**named, **moments}.items()]
    entries += [{"name": "global_step", "data": ms.Tensor(np.array([5], np.int32))},
                {"name": "scale_sense", "data": ms.Tensor(np.float32(1024.0))}]
    ms.save_checkpoint(entries, path, append_dict={"epoch_num": 1, "step_num": 5})
    return hf_w, moments


# --------------------------------------------------------------------------- tests


def test_every_msllm_weight_has_a_mindformers_name_and_back():
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=37)
    expected = {"model.embed_tokens.embedding_table": "model.tok_embeddings.embedding_weight",
                "model.layers.1.self_attn.q_proj.weight": "model.layers.1.attention.wq.weight",
                "model.layers.1.self_attn.o_proj.weight": "model.layers.1.attention.wo.weight",
                "model.layers.0.mlp.gate_proj.weight": "model.layers.0.feed_forward.w1.weight",
                "model.layers.0.mlp.up_proj.weight": "model.layers.0.feed_forward.w3.weight",
                "model.layers.0.mlp.down_proj.weight": "model.layers.0.feed_forward.w2.weight",
                "model.layers.1.input_layernorm.weight": "model.layers.1.attention_norm.weight",
                "model.layers.1.post_attention_layernorm.weight": "model.layers.1.ffn_norm.weight",
                "model.norm.weight": "model.norm_out.weight", "lm_head.weight": "lm_head.weight"}
    for ours, theirs in expected.items():
        assert msllm_to_mindformers_name(ours) == theirs and mindformers_to_msllm_name(theirs) == ours
    for name in param_shapes(cfg):
        mf = msllm_to_mindformers_name(name)
        assert mindformers_to_msllm_name(mf) == name
        assert is_mindformers_name(mf) == (name != "lm_head.weight")
        hf_name = hf.msllm_to_hf_name(name)  # MindFormers' own name_replace agrees with the table
        assert mf_name_replace(hf_name) == mf
    assert mindformers_to_msllm_name("adam_m.model.layers.0.attention.wk.weight") == \
        "adam_m.model.layers.0.self_attn.k_proj.weight"
    assert mindformers_to_msllm_name("global_step") is None


@pytest.mark.parametrize("heads, kv", [(6, 2), (4, 4), (8, 1)])
def test_fused_layout_equals_mindformers_hf2mg(heads, kv):
    d, c, f = 4, heads * 4, 10
    rng = np.random.default_rng(heads * 10 + kv)
    print(f"seed {heads * 10 + kv}")
    q, k, v = (rng.standard_normal((n * d, c)).astype(np.float32) for n in (heads, kv, kv))
    fused = fuse_qkv(q, k, v, heads, kv)
    np.testing.assert_array_equal(fused, mf_qkv_concat_hf2mg(np.concatenate([q, k, v]), heads, kv, c))
    for got, want in zip(split_qkv(fused, heads, kv), (q, k, v)):
        np.testing.assert_array_equal(got, want)
    if kv > 1:  # with more than one kv group the order differs from a plain concatenation
        assert not np.array_equal(fused, np.concatenate([q, k, v]))
    gate, up = rng.standard_normal((f, c)), rng.standard_normal((f, c))
    gh = fuse_gate_up(gate, up)
    np.testing.assert_array_equal(gh, mf_ffn_concat_hf2mg(np.concatenate([gate, up]), f))
    np.testing.assert_array_equal(split_gate_up(gh)[0], gate)
    np.testing.assert_array_equal(split_gate_up(gh)[1], up)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_mindformers_qkv_concat_checkpoint_predicts_trains_and_exports(tmp_path, shape):
    """Prediction: logits equal transformers' on the same weights. Training: the TrainStep gets
    every weight and AdamW moment bit-exactly. Conversion: HF export equals the HF weights."""
    from msllm.models.llama.model import LlamaForCausalLM

    hf_model = make_random_hf_model(seed=3, **SHAPES[shape])
    path = str(tmp_path / "mf_qkv_concat.ckpt")
    hf_w, moments = write_mindformers_checkpoint(hf_model, path, seed=4)
    c = hf_model.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                      num_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                      intermediate_size=c.intermediate_size, seq_length=16, max_position_embeddings=64)
    # predict: the checkpoint has no manifest, so the split takes the network's config
    params = ckpt.load_params(path)
    net = LlamaForCausalLM(cfg)
    ckpt.load_into(net, params, path)
    for p in net.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), hf_w[hf.msllm_to_hf_name(p.name)], err_msg=p.name)
    # train: weights and moments into the train step
    from msllm.config import RunConfig
    from msllm.training.step import TrainStep
    from msllm.training.setup import build_optimizer  # the trainer's own AdamW grouping

    run = RunConfig()
    net2 = LlamaForCausalLM(cfg)
    step = TrainStep(net2, build_optimizer(net2, run, np.full(4, 1e-3, np.float32)), loss_scale="none")
    missing = ckpt.load_into(step, ckpt.load_params(path, cfg), path, strict=False)
    assert missing == ["learning_rate"]  # the schedule is the run's own, not in this checkpoint
    by_name = {p.name: p.asnumpy() for p in step.get_parameters()}
    for mf_name, moment in moments.items():
        if "w_qkv" in mf_name or "w_gate_hidden" in mf_name:
            continue
        np.testing.assert_array_equal(by_name[mindformers_to_msllm_name(mf_name)], moment, err_msg=mf_name)
    for m in ("adam_m.", "adam_v."):  # fused moments, re-fused in MindFormers' own order
        raw = {m + mf_name_replace(hf.msllm_to_hf_name(n)): by_name[m + n] for n in by_name
               if n.startswith("model.layers.")}
        fused = mf_convert_qkv_concat_weight(raw, cfg.num_heads, cfg.kv_heads, cfg.hidden_size, cfg.ffn_size,
                                             prefix=m)
        for i in range(cfg.num_layers):
            for key in (f"{m}model.layers.{i}.attention.w_qkv.weight",
                        f"{m}model.layers.{i}.feed_forward.w_gate_hidden.weight"):
                np.testing.assert_array_equal(fused[key], moments[key])
    assert float(by_name["loss_scale"]) == 1024.0 and int(by_name["global_step"].reshape(-1)[0]) == 5
    # conversion to HF: bit-exact tensors, and transformers parity on a real sentence
    ckpt.write_sidecar(path, cfg)
    hf.convert_msllm_to_hf(path, str(tmp_path / "hf"), progress=False)
    out = hf.read_hf_tensors(str(tmp_path / "hf"))
    for name, w in hf_w.items():
        np.testing.assert_array_equal(out[name], w, err_msg=name)
    report = check_parity(cfg, path, hf_dir=str(tmp_path / "hf"), n_new=2)
    assert report.max_abs_diff < 1e-4 and report.hf_next == report.msllm_next


def test_plain_concat_would_load_wrong_and_wrong_shapes_are_refused(tmp_path):
    """The fix is observable: for GQA the old plain-concat reading gives different weights."""
    rng = np.random.default_rng(7)
    print("seed 7")
    q, k, v = rng.standard_normal((48, 48)), rng.standard_normal((16, 48)), rng.standard_normal((16, 48))
    fused = fuse_qkv(q, k, v, 6, 2)
    assert np.abs(fused[:48] - q).max() > 0.1  # rows 0..47 are not q in MindFormers' order
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, num_layers=1, num_heads=6, n_kv_heads=2, intermediate_size=40)
    params = {"model.layers.0.attention.w_qkv.weight": fused, "model.norm_out.weight": np.ones(48)}
    out = to_msllm_names(params, "x.ckpt", cfg)
    np.testing.assert_array_equal(out["model.layers.0.self_attn.k_proj.weight"], k)
    assert "model.norm.weight" in out
    with pytest.raises(MsllmError, match=r"x\.ckpt: model.layers.0.attention.w_qkv.weight has 72 rows"):
        to_msllm_names({"model.layers.0.attention.w_qkv.weight": np.zeros((72, 48))}, "x.ckpt", cfg)
    with pytest.raises(MsllmError, match=r"x\.ckpt: mixes MindFormers names .*norm_out.* msllm names"):
        to_msllm_names({"model.norm_out.weight": 1, "model.layers.0.self_attn.q_proj.weight": 2}, "x.ckpt")
    plain = {"model.norm.weight": np.ones(3), "adam_m.model.norm.weight": np.zeros(3), "global_step": 1}
    assert to_msllm_names(plain, "x.ckpt") is plain


def test_plain_mindformers_checkpoint_loads_with_identical_logits(tmp_path):
    from msllm.models.llama.model import LlamaForCausalLM

    hf_model = make_random_hf_model(seed=5, **SHAPES["gqa_6q_2kv"])
    path = str(tmp_path / "mf.ckpt")
    hf_w, _ = write_mindformers_checkpoint(hf_model, path, qkv_concat=False)
    c = hf_model.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                      num_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                      intermediate_size=c.intermediate_size, seq_length=16)
    net = LlamaForCausalLM(cfg)
    ckpt.load_into(net, ckpt.load_params(path), path)
    ids = np.array([sentence_ids(cfg.vocab_size, max_len=16)[0]], np.int32)
    import torch

    with torch.no_grad():
        want = hf_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    got = net(ms.Tensor(ids)).asnumpy()
    assert np.abs(got - want).max() < 1e-4
