"""Bit-exact round trips HF -> msllm -> HF and msllm -> HF -> msllm, and the file formats under
them checked against the reference implementations (mindspore.save/load_checkpoint, safetensors,
torch's bf16 rounding)."""

import json
import os

import numpy as np
import pytest

import mindspore as ms

from helpers.families import FAMILY_CASES
from msllm.convert import hf
from msllm.convert.verify import make_random_hf_model
from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig
from msllm.training import checkpoint as ckpt

ms.set_device("CPU")

SMALL = dict(vocab_size=300, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=64)


def torch_tensors(hf_dir):
    """Every tensor of an HF directory, read with the safetensors library (independent reader)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(hf_dir, f)))
    return out


def bits(t):
    import torch
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("dtype,tied,shard", [("float32", False, None), ("bfloat16", True, "20KB"),
                                              ("float16", False, None)])
def test_hf_to_msllm_to_hf_is_bit_exact(tmp_path, dtype, tied, shard):
    src = tmp_path / "hf"
    make_random_hf_model(str(src), seed=7, dtype=dtype, max_shard_size=shard, tie_word_embeddings=tied, **SMALL)
    hf.convert_hf_to_msllm(str(src), str(tmp_path / "m.ckpt"), progress=False)
    hf.convert_msllm_to_hf(str(tmp_path / "m.ckpt"), str(tmp_path / "back"), progress=False,
                           max_shard_size=shard or "2GB")
    a, b = torch_tensors(src), torch_tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(bits(a[name]), bits(b[name]), err_msg=name)
    ca = json.loads((src / "config.json").read_text())
    cb = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "architectures", "model_type", "dtype"):
        assert ca[key] == cb[key], key
    assert cb["rope_parameters"]["rope_theta"] == ca["rope_parameters"]["rope_theta"] == 500000.0
    if shard:
        index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 2
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in b.values())
    assert os.stat(tmp_path / "back").st_mode & 0o755 == 0o755  # not the 0700 of a temp dir


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_msllm_to_hf_to_msllm_is_bit_exact(tmp_path, fmt):
    """Trainer checkpoints in either format (callbacks.checkpoint.format) export and come back."""
    from msllm.models.llama.model import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=200, hidden_size=48, num_layers=2, num_heads=6, n_kv_heads=2,
                      intermediate_size=40, seq_length=32, rope_scaling={"type": "linear", "factor": 4.0})
    ms.set_seed(3)
    net = LlamaForCausalLM(cfg)
    path = str(tmp_path / f"checkpoint_0-1_1.{fmt}")
    ckpt.save_checkpoint(net, path, 1, 1, fmt=fmt, model_config=cfg)
    hf.convert_msllm_to_hf(path, str(tmp_path / "hf"), progress=False)
    hf.convert_hf_to_msllm(str(tmp_path / "hf"), str(tmp_path / "back.ckpt"), progress=False)
    a = ms.load_checkpoint(path, format=fmt)
    b = ms.load_checkpoint(str(tmp_path / "back.ckpt"))
    weights = [p.name for p in net.trainable_params()]
    assert sorted(b) == sorted(weights)
    for name in weights:
        np.testing.assert_array_equal(a[name].asnumpy(), b[name].asnumpy(), err_msg=name)
    back_cfg = ckpt.read_sidecar(str(tmp_path / "back.ckpt"))["model_config"]
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "n_kv_heads", "rope_scaling",
                "rms_norm_eps", "rope_theta", "tie_word_embeddings"):
        assert back_cfg[key] == getattr(cfg, key), key
    assert back_cfg["intermediate_size"] == cfg.ffn_size


def test_ckpt_writer_bytes_equal_mindspore_save_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    tensors = [("a.weight", rng.standard_normal((7, 5)).astype(np.float32), ms.float32, "float32"),
               ("b.half", rng.standard_normal((3,)).astype(np.float16), ms.float16, "float16"),
               ("c.bf16", rng.standard_normal((4, 6)).astype(np.float32), ms.bfloat16, "bfloat16"),
               ("d.big_dims", rng.standard_normal((300, 2)).astype(np.float32), ms.float32, "float32")]
    ref = str(tmp_path / "ref.ckpt")
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(x, t)} for n, x, t, _ in tensors], ref)
    ours = str(tmp_path / "ours.ckpt")
    with hf.CkptWriter(ours) as w:
        for n, x, _, d in tensors:
            w.write(n, hf.cast(x, "float32", d) if d == "bfloat16" else x, d)
    assert open(ours, "rb").read() == open(ref, "rb").read()


def test_ckpt_chunked_values_and_crc_trailer_read_back(tmp_path):
    """Tensors split into several Values (as MindSpore does above 512 MiB; here a tiny chunk)
    load with mindspore.load_checkpoint, and scan_ckpt reads MindSpore's crc_check files."""
    x = np.arange(1000, dtype=np.float32).reshape(100, 10)
    path = str(tmp_path / "chunked.ckpt")
    with hf.CkptWriter(path, chunk=333) as w:
        w.write("x", x, "float32")
        w.write("y", x[:3].astype(np.float16), "float16")
    loaded = ms.load_checkpoint(path)
    np.testing.assert_array_equal(loaded["x"].asnumpy(), x)
    np.testing.assert_array_equal(loaded["y"].asnumpy(), x[:3].astype(np.float16))
    entries = hf.scan_ckpt(path)
    assert len(entries["x"].slices) == 13 and entries["x"].shape == (100, 10)
    np.testing.assert_array_equal(entries["x"].load(), x)

    crc = str(tmp_path / "crc.ckpt")
    ms.save_checkpoint([{"name": "x", "data": ms.Tensor(x)}], crc, crc_check=True,
                       append_dict={"epoch_num": 3})
    entries = hf.scan_ckpt(crc)
    np.testing.assert_array_equal(entries["x"].load(), x)
    assert int(entries["epoch_num"].load()) == 3


def test_bf16_rounding_is_torchs():
    import torch

    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10000),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.00390625, 1.01171875, 3.4e38, 1e-40],
                                 np.float32)])
    ours = hf.f32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    back = hf.bf16_bits_to_f32(ours)
    np.testing.assert_array_equal(back, torch.from_numpy(theirs.view(np.int16)).view(torch.bfloat16).float().numpy())
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(hf.cast(x, "float32", "float16"), x.astype(np.float16))


def test_safetensors_writer_reads_back_with_the_library(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.float16)
    path = str(tmp_path / "x.safetensors")
    with hf.SafetensorsWriter(path, [("a", "float32", (3, 4)), ("b", "float16", (5,))]) as w:
        w.write("a", a)
        w.write("b", b)
    got = load_file(path)
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)
    with safe_open(path, framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    start, entries, meta = hf.read_safetensors_header(path)
    assert start % 8 == 0 and entries["b"][:2] == ("float16", (5,))


def test_sizes_and_shards():
    assert hf.parse_size("2GB") == 2 * 10 ** 9 and hf.parse_size("1GiB") == 2 ** 30
    assert hf.parse_size("500") == 500 and hf.parse_size("1.5MB") == 1500000
    with pytest.raises(MsllmError, match="max_shard_size"):
        hf.parse_size("lots")
    assert hf.plan_shards([("a", 5), ("b", 5), ("c", 20), ("d", 1)], 10) == [["a", "b"], ["c"], ["d"]]


def test_name_table_round_trips():
    cfg = LlamaConfig(vocab_size=10, hidden_size=8, num_layers=3, num_heads=2, seq_length=4)
    for name in hf.param_shapes(cfg):
        h = hf.msllm_to_hf_name(name)
        assert h is not None and hf.hf_to_msllm_name(h) == name
        assert hf.translate_name(hf.translate_name(name, "msllm", "meta"), "meta", "msllm") == name
    assert hf.hf_to_msllm_name("model.embed_tokens.weight") == "model.embed_tokens.embedding_table"
    assert hf.msllm_to_hf_name("model.layers.12.mlp.down_proj.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf.hf_to_msllm_name("model.layers.0.mlp.bogus.weight") is None


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_each_family_round_trips_bit_exactly_and_loads_in_transformers(tmp_path, case):
    """HF (Qwen2, Qwen3, Mistral, Gemma, LLaMA with attention_bias) -> msllm -> HF: every tensor
    bit-exact, the family's config keys kept, and the written directory loads in transformers as
    the same architecture with the same logits as the source."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = dict(FAMILY_CASES[case])
    src = tmp_path / "hf"
    model = make_random_hf_model(str(src), seed=9, **kw)
    hf.convert_hf_to_msllm(str(src), str(tmp_path / "m.ckpt"), progress=False)
    hf.convert_msllm_to_hf(str(tmp_path / "m.ckpt"), str(tmp_path / "back"), progress=False)
    a, b = torch_tensors(src), torch_tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(bits(a[name]), bits(b[name]), err_msg=name)
    ca = json.loads((src / "config.json").read_text())
    cb = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("architectures", "model_type", "head_dim", "hidden_act", "tie_word_embeddings", "sliding_window",
                "attention_bias", "rope_parameters", "num_key_value_heads", "num_experts_per_tok", "norm_topk_prob",
                "moe_intermediate_size", "shared_expert_intermediate_size", "mlp_only_layers", "decoder_sparse_step",
                "router_aux_loss_coef"):
        if ca.get(key) is not None:   # (Mixtral writes head_dim null: derived, written back as the value)
            assert ca[key] == cb[key] or (key == "sliding_window" and not ca.get("use_sliding_window", True)), key
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32,
                                                attn_implementation="eager").eval()
    assert type(back) is type(model)
    ids = torch.tensor([[1, 5, 9, 300, 2, 17, 44, 8, 8, 120, 33, 5, 7, 90, 91, 92, 3, 4, 6, 10, 11]])
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)
