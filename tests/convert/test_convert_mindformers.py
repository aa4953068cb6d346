"""MindFormers-named LLaMA checkpoints: names map both ways, a MindFormers checkpoint (with its
optimizer state and counters, plain or qkv_concat) loads into msllm through to_msllm_names with
bit-identical logits, and exports to HF with transformers parity."""

import numpy as np
import pytest

import mindspore as ms

from msllm.convert import hf
from msllm.convert.mindformers import (concat_splits, is_mindformers_name, mindformers_to_msllm_name,
                                       msllm_to_mindformers_name)
from msllm.convert.names import to_msllm_names
from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig
from msllm.training import checkpoint as ckpt

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)

CFG = LlamaConfig(vocab_size=320, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2,
                  intermediate_size=37, seq_length=16, rope_theta=500000.0)


def test_every_msllm_weight_has_a_mindformers_name_and_back():
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
    for name in hf.param_shapes(CFG):
        mf = msllm_to_mindformers_name(name)
        assert mindformers_to_msllm_name(mf) == name
        assert is_mindformers_name(mf) == (name != "lm_head.weight")
    assert mindformers_to_msllm_name("adam_m.model.layers.0.attention.wk.weight") == \
        "adam_m.model.layers.0.self_attn.k_proj.weight"
    assert mindformers_to_msllm_name("global_step") is None


def random_net(seed=0):
    from msllm.models.llama.model import LlamaForCausalLM

    ms.set_seed(seed)
    net = LlamaForCausalLM(CFG)
    rng = np.random.default_rng(seed)
    for p in net.trainable_params():  # O(1) logits, norms not all ones
        shape = p.shape
        val = 1 + 0.2 * rng.standard_normal(shape) if len(shape) == 1 else rng.standard_normal(shape) / np.sqrt(shape[-1])
        p.set_data(ms.Tensor(val.astype(np.float32)))
    return net


def save_mindformers(net, path, qkv_concat=False):
    """A checkpoint as MindFormers' trainer writes it: MindFormers names, optimizer moments
    (adam_m/adam_v), counters and scale_sense; optionally qkv_concat (w_qkv, w_gate_hidden)."""
    params = {p.name: p.asnumpy() for p in net.trainable_params()}
    named = {msllm_to_mindformers_name(n): v for n, v in params.items()}
    if qkv_concat:
        for i in range(CFG.num_layers):
            a = f"model.layers.{i}.attention."
            named[a + "w_qkv.weight"] = np.concatenate([named.pop(a + f"w{x}.weight") for x in "qkv"], 0)
            f = f"model.layers.{i}.feed_forward."
            named[f + "w_gate_hidden.weight"] = np.concatenate([named.pop(f + "w1.weight"),
                                                                named.pop(f + "w3.weight")], 0)
    entries = [{"name": n, "data": ms.Tensor(v)} for n, v in named.items()]
    entries += [{"name": f"adam_m.{n}", "data": ms.Tensor(np.zeros_like(v))} for n, v in named.items()]
    entries += [{"name": f"adam_v.{n}", "data": ms.Tensor(np.ones_like(v))} for n, v in named.items()]
    entries += [{"name": "global_step", "data": ms.Tensor(np.array([5], np.int32))},
                {"name": "scale_sense", "data": ms.Tensor(np.float32(1024.0))}]
    ms.save_checkpoint(entries, path, append_dict={"epoch_num": 1, "step_num": 5})


@pytest.mark.parametrize("qkv_concat", [False, True])
def test_mindformers_checkpoint_loads_with_identical_logits(tmp_path, qkv_concat):
    from msllm.models.llama.model import LlamaForCausalLM

    net = random_net(1)
    path = str(tmp_path / "mindformers_llama.ckpt")
    save_mindformers(net, path, qkv_concat)
    params = ckpt.load_params(path)  # the trainer's loader renames MindFormers names itself
    assert not any("attention.w" in n for n in params)
    assert "model.layers.0.self_attn.q_proj.weight" in params
    renamed = to_msllm_names(params, path)  # and renaming again changes nothing
    assert renamed.keys() == params.keys()
    assert "adam_m.model.layers.1.self_attn.v_proj.weight" in renamed and "scale_sense" in renamed
    fresh = LlamaForCausalLM(CFG)
    ckpt.load_into(fresh, renamed, path)  # strict: every msllm parameter was found
    from msllm.convert.verify import sentence_ids
    ids = ms.Tensor(np.array([sentence_ids(CFG.vocab_size, max_len=CFG.seq_length)[0]], np.int32))
    a, b = net(ids).asnumpy(), fresh(ids).asnumpy()
    assert np.std(a) > 0.3
    np.testing.assert_array_equal(a, b)


def test_msllm_names_are_returned_unchanged_and_mixed_naming_is_refused():
    params = {"model.norm.weight": np.ones(3), "adam_m.model.norm.weight": np.zeros(3), "global_step": 1}
    assert to_msllm_names(params, "x.ckpt") is params
    with pytest.raises(MsllmError, match=r"x\.ckpt: mixes MindFormers names .*norm_out.* msllm names"):
        to_msllm_names({"model.norm_out.weight": 1, "model.layers.0.self_attn.q_proj.weight": 2}, "x.ckpt")
    with pytest.raises(MsllmError, match="w_qkv"):
        to_msllm_names({"model.layers.0.attention.w_qkv.weight": np.zeros((9, 4))}, "x.ckpt")
    assert concat_splits("model.layers.3.feed_forward.w_gate_hidden.weight", 10, 4) == [
        ("model.layers.3.mlp.gate_proj.weight", 0, 5), ("model.layers.3.mlp.up_proj.weight", 5, 10)]


def test_mindformers_checkpoint_exports_to_hf_with_parity(tmp_path):
    from msllm.convert.verify import check_parity

    net = random_net(2)
    path = str(tmp_path / "mf.ckpt")
    save_mindformers(net, path, qkv_concat=True)
    ckpt.write_sidecar(path, CFG)
    hf.convert_msllm_to_hf(path, str(tmp_path / "hf"), progress=False)
    report = check_parity(CFG, path, hf_dir=str(tmp_path / "hf"), n_new=3)
    assert report.max_abs_diff < 1e-4 and report.hf_next == report.msllm_next
