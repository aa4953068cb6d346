"""Rotary tables against transformers' ``LlamaRotaryEmbedding`` (the independent reference), for
every rope type msllm implements, through both directions of the config conversion."""

import numpy as np
import pytest
import torch
import transformers

from msllm.convert.configs import hf_config_to_msllm, msllm_config_to_hf
from msllm.errors import MsllmError
from msllm.models.llama.rotary import rotary_tables

# transformers forms the angles pos x inv_freq in float32 (msllm in float64, then rounds): at
# positions up to 512 that alone differs by up to 512 x 2^-24 ~ 3e-5 rad; a wrong scaling differs by > 0.1
TOL = 4e-5
BASE = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=600, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=512)
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    # Llama 3.1 8B's values except original_max_position_embeddings (8192 there): at head_dim 16 and
    # theta 5e5, 256 puts wavelengths below, inside and above the blended band
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    # YaRN as Qwen2.5 documents it ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    # the original length scaled down to the test's 512 positions; with DeepSeek-style mscale pair; and
    # with truncate false (transformers 5's key) and explicit betas
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 1.0},
    "yarn_betas_no_truncate": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
                               "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
}


def hf_tables(config_dict: dict) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (P, D) of transformers' rotary embedding for the positions 0..P-1."""
    cfg = transformers.LlamaConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    pos = torch.arange(cfg.max_position_embeddings)[None]
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].numpy(), sin[0].numpy()


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_tables_equal_transformers_both_ways(kind):
    hf_dict = dict(BASE, **({"rope_scaling": SCALINGS[kind]} if SCALINGS[kind] else {}))
    cfg = hf_config_to_msllm(hf_dict)
    cos, sin = rotary_tables(cfg)
    ref_cos, ref_sin = hf_tables(hf_dict)
    np.testing.assert_allclose(cos, ref_cos, atol=TOL)
    np.testing.assert_allclose(sin, ref_sin, atol=TOL)
    # msllm -> config.json -> transformers computes the same tables again
    back_cos, back_sin = hf_tables(msllm_config_to_hf(cfg))
    np.testing.assert_allclose(cos, back_cos, atol=TOL)
    np.testing.assert_allclose(sin, back_sin, atol=TOL)
    if kind != "default":  # the scaling is not a no-op here: low frequencies moved (or the scale changed)
        plain_cos, _ = hf_tables(BASE)
        assert np.abs(cos - plain_cos).max() > 0.1


@pytest.mark.parametrize("spec, message", [
    ({"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 32768},
     "rotary scaling 'longrope' is not implemented"),
    ({"rope_type": "yarn", "factor": 4.0}, "needs original_max_position_embeddings"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rotary scaling 'dynamic' is not implemented"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "needs high_freq_factor, original_max_position_embeddings"),
])
def test_other_rope_types_are_refused_naming_them(spec, message):
    with pytest.raises(MsllmError, match=message):
        hf_config_to_msllm(dict(BASE, rope_scaling=spec))


@pytest.mark.parametrize("kind", ["default", "yarn_mscale"])
def test_numpy_tables_are_the_graph_s_bits(kind):
    """rotary_cos_sin against MindSpore's own CPU operators, the graph's computation (LlamaModel.rotary: Cast, Mul,
    Concat, Cos, Sin, Mul by the factor), at positions up to 131k: equal bit for bit (the direct decode step feeds
    its tables to the kernels in the graph's place)."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from msllm.models.llama.rotary import rotary_cos_sin, rotary_frequencies

    hf_dict = dict(BASE, **({"rope_scaling": SCALINGS[kind]} if SCALINGS[kind] else {}))
    inv_freq, factor = rotary_frequencies(hf_config_to_msllm(hf_dict))
    pos = np.arange(0, 131072, 13, dtype=np.int32)[None]                        # (1, N)
    angles = ops.cast(Tensor(pos), ms.float32)[:, :, None] * Tensor(inv_freq[None, :])
    angles = ops.concat((angles, angles), -1)
    cos, sin = ops.cos(angles), ops.sin(angles)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    mine_cos, mine_sin = rotary_cos_sin(pos, inv_freq, factor)
    assert np.array_equal(mine_cos, cos.asnumpy()) and np.array_equal(mine_sin, sin.asnumpy())
