"""Meta (consolidated.NN.pth + params.json) q/k layout: permute / unpermute are inverses, equal HF's
``permute``, turn Meta's interleaved rotary into HF's rotate_half, and a Meta-layout checkpoint
built from an HF model converts to msllm with HF logits parity."""

import json
import os

import numpy as np
import pytest

from msllm.convert import hf
from msllm.convert.verify import check_parity, make_random_hf_model


@pytest.mark.parametrize("heads,head_dim,cols", [(4, 8, 32), (2, 8, 32), (1, 16, 24), (8, 2, 5)])
def test_permute_and_unpermute_are_inverse_and_equal_hfs_permute(heads, head_dim, cols):
    import torch

    rng = np.random.default_rng(heads * 100 + head_dim)
    w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
    hf_layout = hf.permute_meta_to_hf(w, heads)
    np.testing.assert_array_equal(hf.permute_hf_to_meta(hf_layout, heads), w)
    np.testing.assert_array_equal(hf.permute_meta_to_hf(hf.permute_hf_to_meta(w, heads), heads), w)
    assert np.array_equal(hf_layout, w) == (head_dim == 2)  # with D = 2 the layouts coincide
    # HF transformers/models/llama/convert_llama_weights_to_hf.py, permute(), literally
    t = torch.from_numpy(w)
    ref = t.view(heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(heads * head_dim, cols)
    np.testing.assert_array_equal(hf_layout, ref.numpy())


def test_permutation_turns_meta_rotary_into_rotate_half():
    """Meta rotates adjacent pairs as complex numbers (llama/model.py apply_rotary_emb); HF rotates
    (x_j, x_{j+D/2}) (rotate_half). With the permuted weight, HF's rotated q equals Meta's rotated
    q with its rows permuted, so every q.k score is unchanged."""
    rng = np.random.default_rng(0)
    heads, d, c, theta, pos = 2, 8, 12, 10000.0, 7
    wq = rng.standard_normal((heads * d, c))
    wk = rng.standard_normal((heads * d, c))
    x, y = rng.standard_normal(c), rng.standard_normal(c)
    freqs = theta ** (-np.arange(0, d, 2) / d)

    def meta_rope(v, p):  # (heads*d,) -> rotated, pairs as complex numbers
        z = v.reshape(heads, d // 2, 2) @ np.array([1, 1j])
        z = z * np.exp(1j * p * freqs)
        return np.stack([z.real, z.imag], -1).reshape(-1)

    def hf_rope(v, p):
        v = v.reshape(heads, d)
        ang = np.concatenate([p * freqs, p * freqs])
        rot = np.concatenate([-v[:, d // 2:], v[:, :d // 2]], -1)
        return (v * np.cos(ang) + rot * np.sin(ang)).reshape(-1)

    q_meta, k_meta = meta_rope(wq @ x, pos), meta_rope(wk @ y, 3)
    q_hf = hf_rope(hf.permute_meta_to_hf(wq, heads) @ x, pos)
    k_hf = hf_rope(hf.permute_meta_to_hf(wk, heads) @ y, 3)
    np.testing.assert_allclose(q_hf, hf.permute_meta_to_hf(q_meta[:, None], heads)[:, 0], atol=1e-12)
    for h in range(heads):
        sl = slice(h * d, (h + 1) * d)
        assert np.isclose(q_hf[sl] @ k_hf[sl], q_meta[sl] @ k_meta[sl])


def write_meta_checkpoint(model, out_dir, shards=1):
    """A Meta-layout checkpoint of HF ``model`` (q/k unpermuted, Meta names, model-parallel split
    the way Meta's checkpoints are: column-parallel weights by rows, wo/w2/embedding by columns)."""
    import torch

    cfg = model.config
    os.makedirs(out_dir, exist_ok=True)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    meta = {}
    for name, t in sd.items():
        mname = hf.translate_name(name, "hf", "meta")
        assert mname is not None, name
        w = t.numpy()
        if ".wq." in mname:
            w = hf.permute_hf_to_meta(w, cfg.num_attention_heads)
        elif ".wk." in mname:
            w = hf.permute_hf_to_meta(w, cfg.num_key_value_heads)
        meta[mname] = torch.from_numpy(np.ascontiguousarray(w))
    for s in range(shards):
        part = {"rope.freqs": torch.ones(cfg.hidden_size // cfg.num_attention_heads // 2)}
        for name, t in meta.items():
            if t.ndim == 1:
                part[name] = t.clone()
                continue
            axis = 1 if name.startswith("tok_embeddings") or ".wo." in name or ".w2." in name else 0
            part[name] = torch.chunk(t, shards, dim=axis)[s].clone()
        torch.save(part, os.path.join(out_dir, f"consolidated.{s:02d}.pth"))
    with open(os.path.join(out_dir, "params.json"), "w") as fh:
        json.dump({"dim": cfg.hidden_size, "n_layers": cfg.num_hidden_layers, "n_heads": cfg.num_attention_heads,
                   "n_kv_heads": cfg.num_key_value_heads, "vocab_size": -1, "multiple_of": 16,
                   "ffn_dim_multiplier": None, "norm_eps": cfg.rms_norm_eps,
                   "rope_theta": cfg.rope_parameters["rope_theta"], "max_seq_len": 128}, fh)


@pytest.mark.parametrize("shards", [1, 2])
def test_meta_checkpoint_converts_with_hf_logits_parity(tmp_path, shards):
    model = make_random_hf_model(None, seed=21, vocab_size=400, hidden_size=64, intermediate_size=72,
                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                 rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=128)
    write_meta_checkpoint(model, str(tmp_path / "meta"), shards)
    out = str(tmp_path / "m.ckpt")
    res = hf.convert_hf_to_msllm(str(tmp_path / "meta"), out, progress=False)
    assert res.source_kind == "meta"
    c = res.config
    assert (c.vocab_size, c.ffn_size, c.kv_heads, c.rope_theta) == (400, 72, 2, 500000.0)
    # the stored q weight is HF layout again, bit for bit
    q = hf.read_msllm_tensors(out)["model.layers.1.self_attn.q_proj.weight"][0]
    np.testing.assert_array_equal(q, model.model.layers[1].self_attn.q_proj.weight.detach().numpy())
    report = check_parity(c, out, hf=model, n_new=3)
    assert report.max_abs_diff < 1e-4 and report.hf_next == report.msllm_next
