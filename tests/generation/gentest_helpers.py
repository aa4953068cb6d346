"""Helpers of the generation tests: real prompts, random HF models, transformers' generate."""

from __future__ import annotations

import numpy as np

from helpers import REPO as ROOT, TINY_YAML  # noqa: F401  (re-exported to the generation tests)
from helpers.families import FAMILY_CASES

# Three real sentences of different lengths (8, 26 and 2 tokens with BOS).
SENTENCES = ["I love Beijing, because",
             "The capital of France is Paris, and the capital of Germany is Berlin. In 1969, Neil Armstrong",
             "Hello"]

# The model configs of tests/convert/test_convert_hf_parity.py (transformers LlamaConfig fields,
# file format, stored dtype): MHA, GQA + tied embeddings + rope_theta 5e5, GQA + linear rope
# scaling, GQA + Llama 3.1 rope scaling, MQA in bf16.
CASES = {
    "mha_untied_vocab32000": (dict(vocab_size=32000, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128),
                              "safetensors", "float32"),
    "gqa_tied_theta5e5": (dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                               num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
                               tie_word_embeddings=True, max_position_embeddings=96), "safetensors", "float32"),
    "gqa_linear_rope": (dict(vocab_size=500, hidden_size=48, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=3, rope_theta=1e6,
                             rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=256),
                        "bin", "float32"),
    # Llama 3.1's rotary scaling: head_dim 16 at theta 5e5 has wavelengths below 64 (kept), between
    # 64 and 256 (blended) and above 256 (divided by 8)
    "gqa_llama3_rope": (dict(vocab_size=600, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                             max_position_embeddings=512), "safetensors", "float32"),
    "mqa_bf16": (dict(vocab_size=700, hidden_size=32, intermediate_size=50, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64),
                 "safetensors", "bfloat16"),
    **{k: (kw, "safetensors", "float32") for k, kw in FAMILY_CASES.items()},
}


def prompts_for(tokenizer, vocab_size: int, sentences=SENTENCES) -> list[list[int]]:
    """[bos] + tokens of each sentence (ids mod vocab_size for a smaller random vocabulary)."""
    return [[i % vocab_size for i in [tokenizer.bos_id] + tokenizer.encode(s)] for s in sentences]


def hf_generate(model, prompts, pad_id: int = 0, **kwargs):
    """transformers ``generate`` on a left-padded batch (the layout HF documents for decoder-only
    batches); returns the output object (``return_dict_in_generate``) and the padded length."""
    import torch

    length = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad_id, return_dict_in_generate=True,
                             **kwargs)
    return out, length


def hf_new_tokens(out, length: int) -> list[list[int]]:
    return out.sequences[:, length:].tolist()


def same_tokens(ours: list[int], ref: list[int], fill: int) -> bool:
    """``ours`` (a row's new tokens, ending at EOS if it stopped) equals HF's row, whose tail after
    the stop is filled with ``fill``."""
    n = len(ours)
    return ref[:n] == ours and all(t == fill for t in ref[n:])


def converted_model(d, seed: int, hf_kw: dict, generation_config: dict, template: str = "vicuna_v1.1") -> dict:
    """A seeded random HF LLaMA saved in ``d/hf`` (``hf_kw``: transformers config fields) and
    converted to ``d/llama.ckpt``, whose manifest records ``template`` (key ``"template"``, as the
    trainer records the dataset's template), plus ``d/run.yaml``: the tiny run YAML with the
    converted model config, ``seq_length`` 128 and ``generation_config``.

    Returns dict(hf=transformers model, hf_dir, ckpt, yaml=run YAML path)."""
    import json

    import yaml

    from msllm.convert import hf as hfconv
    from msllm.convert.configs import model_config_yaml
    from msllm.convert.verify import make_random_hf_model

    print("seed", seed)
    hf_model = make_random_hf_model(str(d / "hf"), seed=seed, **hf_kw)
    ckpt = str(d / "llama.ckpt")
    res = hfconv.convert_hf_to_msllm(str(d / "hf"), ckpt, progress=False)
    with open(ckpt + ".json") as fh:
        manifest = json.load(fh)
    manifest["template"] = template
    with open(ckpt + ".json", "w") as fh:
        json.dump(manifest, fh)
    run = yaml.safe_load(open(TINY_YAML))
    run["model"]["model_config"] = {**yaml.safe_load(model_config_yaml(res.config))["model"]["model_config"],
                                    "seq_length": 128}
    run["generation_config"] = generation_config
    with open(d / "run.yaml", "w") as fh:
        yaml.safe_dump(run, fh)
    return dict(hf=hf_model, hf_dir=str(d / "hf"), ckpt=ckpt, yaml=str(d / "run.yaml"))


def net_from_hf_dir(path: str):
    """msllm network loaded from an HF directory through the inference loader."""
    from msllm.config import RunConfig
    from msllm.generation.loading import load_for_inference

    net, mc, info = load_for_inference(RunConfig(), path)
    return net, mc, info


def max_logit_diff(ours: list, ref, active: np.ndarray) -> float:
    """max |diff| of per-step logits (ours: list of (B, V); ref: HF's tuple of (B, V) tensors) over
    the rows still generating at each step (``active`` (steps, B) bool)."""
    worst = 0.0
    for k, (a, b) in enumerate(zip(ours, ref)):
        rows = active[k]
        if rows.any():
            worst = max(worst, float(np.abs(a[rows] - b.numpy()[rows]).max()))
    return worst


SMOLLM2_YAML = f"{ROOT}/configs/smollm2/run_smollm2_135m.yaml"


def load_smollm2(smollm2_dir: str, overrides: list):
    """SmolLM2 from its cached HF directory for inference (``load_for_inference``): (net, model
    config, tokenizer), with ``overrides`` (CLI-style ``--key=value``) on the SmolLM2 run YAML."""
    from msllm.config import load_config
    from msllm.generation.loading import load_for_inference

    return load_for_inference(load_config(SMOLLM2_YAML, overrides + [f"--load_checkpoint={smollm2_dir}"]))


def every_position_logits(net, mc, seqs: list) -> list:
    """Logits at every position of each sequence, from one left-padded prefill into a fresh cache:
    ``seqs`` token-id lists -> [(n_i, V) float32 per sequence], the row's real positions only."""
    import mindspore as ms
    from mindspore import nn

    from msllm.models.llama.batch_layout import key_positions, left_pad, positions_for
    from msllm.models.llama.kv_cache import cache_index, empty_cache

    class EveryPosition(nn.Cell):
        def __init__(self, net):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, ids, positions, kpos, index, caches):
            return self.net.forward_cached(ids, positions, kpos, index, caches, False, True)   # (B, T, V)

    length = max(map(len, seqs))
    ids, pads = left_pad(seqs, length, 0)
    slots = np.arange(length)
    caches = empty_cache(len(seqs), mc.kv_heads, length, mc.head_dim, mc.num_layers)
    out = EveryPosition(net)(ms.Tensor(ids), ms.Tensor(positions_for(pads, slots)), ms.Tensor(key_positions(pads, length)),
                             ms.Tensor(cache_index(slots, len(seqs))), ms.mutable(caches)).asnumpy()
    return [out[i, p:] for i, p in enumerate(pads)]
