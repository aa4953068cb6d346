"""Model configs: Hugging Face ``config.json`` and Meta ``params.json`` <-> msllm :class:`LlamaConfig`,
and the ``model_config`` block of a run YAML.

Sources: ``transformers/models/llama/configuration_llama.py`` (``LlamaConfig`` fields; rope
settings as legacy ``rope_theta``/``rope_scaling`` or transformers-5 ``rope_parameters``),
``facebookresearch/llama`` ``params.json`` (``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``,
``norm_eps``, ``rope_theta``, ``vocab_size`` -1 in LLaMA-1/2) and HF
``convert_llama_weights_to_hf.py`` for the Meta defaults.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig, check_rope_scaling


def read_json(path: str, what: str) -> object:
    if not os.path.isfile(path):
        raise MsllmError(f"{path}: {what} not found")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise MsllmError(f"{path}: {what} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MsllmError(f"{path}: {what} cannot be read ({exc})") from None


def _hf_rope(hf: dict, where: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, msllm rope_scaling) from legacy ``rope_theta``/``rope_scaling`` or the
    transformers-5 ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or None
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    spec = scaling if scaling is not None else params
    if not isinstance(spec, dict):
        raise MsllmError(f"{where}: rope_scaling/rope_parameters must be an object, got {spec!r}")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    key = "rope_scaling" if scaling is not None else "rope_parameters"
    return float(theta), check_rope_scaling(spec, f"{where}: {key}")


def hf_config_to_msllm(hf: dict, where: str = "config.json") -> LlamaConfig:
    """HF ``LlamaConfig`` dict (``config.json``) -> msllm :class:`LlamaConfig`.

    Field mapping: num_hidden_layers -> num_layers, num_attention_heads -> num_heads,
    num_key_value_heads -> n_kv_heads, rope_theta / rope_parameters.rope_theta -> rope_theta,
    rope_scaling (linear only) -> rope_scaling; ``seq_length`` is set to max_position_embeddings
    (a run YAML sets its own). ``eos_token_id`` lists keep their first id; ``pad_token_id`` null -> 0.

    Raises MsllmError naming ``where`` and the key: not ``model_type: llama`` /
    ``LlamaForCausalLM``, a missing or non-integer size, biases, an activation other than silu,
    ``head_dim != hidden_size / num_attention_heads``, an unsupported rope scaling.
    """
    if not isinstance(hf, dict):
        raise MsllmError(f"{where}: expected a JSON object")
    archs = hf.get("architectures")
    if hf.get("model_type") != "llama" or (archs is not None and archs != ["LlamaForCausalLM"]):
        raise MsllmError(f"{where}: unsupported architecture (model_type={hf.get('model_type')!r}, "
                         f"architectures={archs!r}); expected model_type 'llama' and ['LlamaForCausalLM']")

    def need_int(key, default=None):
        value = hf.get(key)
        value = default if value is None else value
        if value is None or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MsllmError(f"{where}: {key} must be a positive integer, got {value!r}")
        return value

    heads = need_int("num_attention_heads")
    hidden = need_int("hidden_size")
    kv = need_int("num_key_value_heads", heads)
    if hf.get("hidden_act", "silu") != "silu":
        raise MsllmError(f"{where}: hidden_act={hf['hidden_act']!r}; msllm's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise MsllmError(f"{where}: {key}=true is not supported (msllm LLaMA has no biases)")
    if hf.get("head_dim") not in (None, hidden // heads):
        raise MsllmError(f"{where}: head_dim={hf['head_dim']} differs from hidden_size / "
                         f"num_attention_heads = {hidden // heads}; not supported")
    theta, scaling = _hf_rope(hf, where)
    max_pos = need_int("max_position_embeddings", 2048)
    eos = hf.get("eos_token_id", 2)
    if isinstance(eos, list):
        eos = eos[0] if eos else 2
    pad = hf.get("pad_token_id")
    try:
        return LlamaConfig(
            vocab_size=need_int("vocab_size"), hidden_size=hidden, num_layers=need_int("num_hidden_layers"),
            num_heads=heads, n_kv_heads=kv, intermediate_size=need_int("intermediate_size"),
            seq_length=max_pos, max_position_embeddings=max_pos,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=int(hf.get("bos_token_id") if hf.get("bos_token_id") is not None else 1),
            eos_token_id=int(eos if eos is not None else 2), pad_token_id=int(pad if pad is not None else 0),
            initializer_range=float(hf.get("initializer_range", 0.02)))
    except MsllmError as exc:
        raise MsllmError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise MsllmError(f"{where}: {exc}") from None


def msllm_config_to_hf(cfg: LlamaConfig, dtype: str = "float32") -> dict:
    """msllm :class:`LlamaConfig` -> HF ``config.json`` dict for ``LlamaForCausalLM``.

    Writes both the legacy ``rope_theta``/``rope_scaling``/``torch_dtype`` keys (transformers 4)
    and ``rope_parameters``/``dtype`` (transformers 5); both versions load it.
    """
    scaling = None
    rope_parameters = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        spec = check_rope_scaling(cfg.rope_scaling, "model_config.rope_scaling")
        kind, keys = spec.pop("type"), spec
        scaling = {"type": kind, "rope_type": kind, **keys}
        rope_parameters = {"rope_type": kind, "rope_theta": float(cfg.rope_theta), **keys}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


YAML_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "n_kv_heads", "intermediate_size",
             "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
             "bos_token_id", "eos_token_id", "pad_token_id")


def model_config_yaml(cfg: LlamaConfig) -> str:
    """The ``model: model_config:`` block of a run YAML for ``cfg`` (shape keys only)."""
    import yaml

    d = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
         "num_heads": cfg.num_heads, "n_kv_heads": cfg.kv_heads, "intermediate_size": cfg.ffn_size,
         "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": float(cfg.rope_theta),
         "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_positions,
         "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
         "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    if d["rope_scaling"] is None:
        del d["rope_scaling"]
    return yaml.safe_dump({"model": {"model_config": d}}, sort_keys=False, default_flow_style=False)


def meta_params_to_msllm(params: dict, where: str, vocab_rows: int, ffn_rows: int) -> LlamaConfig:
    """Meta ``params.json`` -> :class:`LlamaConfig`.

    ``vocab_size`` is -1 in LLaMA-1/2 params.json: the embedding's row count ``vocab_rows`` is
    used; the SwiGLU width is the w1 row count ``ffn_rows``. Without ``max_seq_len`` the context is
    2048 (the LLaMA-1 value, as HF's converter assumes for version 1).
    """
    if not isinstance(params, dict):
        raise MsllmError(f"{where}: expected a JSON object")
    try:
        dim, n_layers, n_heads = int(params["dim"]), int(params["n_layers"]), int(params["n_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MsllmError(f"{where}: needs integer dim, n_layers and n_heads ({exc})") from None
    max_pos = int(params.get("max_seq_len", 2048))
    try:
        return LlamaConfig(vocab_size=vocab_rows, hidden_size=dim, num_layers=n_layers, num_heads=n_heads,
                           n_kv_heads=int(params.get("n_kv_heads") or n_heads), intermediate_size=ffn_rows,
                           seq_length=max_pos, max_position_embeddings=max_pos,
                           rms_norm_eps=float(params.get("norm_eps", 1e-5)),
                           rope_theta=float(params.get("rope_theta", 10000.0)))
    except MsllmError as exc:
        raise MsllmError(f"{where}: {exc}") from None


__all__ = ["read_json", "hf_config_to_msllm", "msllm_config_to_hf", "meta_params_to_msllm", "model_config_yaml",
           "YAML_KEYS"]
