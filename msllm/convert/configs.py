"""Model configs: Hugging Face ``config.json`` and Meta ``params.json`` <-> msllm :class:`LlamaConfig`,
and the ``model_config`` block of a run YAML.

Sources: ``transformers/models/{llama,qwen2,qwen3,mistral,gemma}/configuration_*.py`` (fields; rope
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
from msllm.models.llama.config import LlamaConfig, MoeConfig, check_rope_scaling
from msllm.models.llama.families import FAMILIES, SWITCH_DEFAULTS, UNSUPPORTED_KEYS, check_representable


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


def _check_unsupported(hf: dict, where: str) -> None:
    """Refuse, naming the key, any HF feature msllm does not implement
    (:data:`msllm.models.llama.families.UNSUPPORTED_KEYS`; ``layer_types`` with a non-full layer)."""
    for key, off in UNSUPPORTED_KEYS.items():
        value = hf.get(key, off)
        if value is not None and value != off and not (off is None and value is False):
            raise MsllmError(f"{where}: {key}={value!r} is not supported by msllm (a feature its LLaMA "
                             f"family does not implement); expected {off!r} or no such key")
    kinds = set(hf.get("layer_types") or ())
    if kinds - {"full_attention"}:
        raise MsllmError(f"{where}: layer_types={sorted(kinds)!r}: msllm runs every layer with the same "
                         f"attention (full, or sliding_window on all layers); per-layer kinds are not supported")


def hf_config_to_msllm(hf: dict, where: str = "config.json") -> LlamaConfig:
    """HF ``config.json`` of a LLaMA-family model -> msllm :class:`LlamaConfig`.

    Families (``model_type`` / ``architectures``, :data:`msllm.models.llama.families.FAMILIES`):
    llama / ``LlamaForCausalLM``, qwen2 / ``Qwen2ForCausalLM``, qwen3 / ``Qwen3ForCausalLM``, mistral /
    ``MistralForCausalLM``, gemma / ``GemmaForCausalLM``. Field mapping: num_hidden_layers ->
    num_layers, num_attention_heads -> num_heads, num_key_value_heads -> n_kv_heads, head_dim,
    rope_theta / rope_parameters.rope_theta -> rope_theta, rope_scaling / rope_parameters (linear,
    llama3, yarn) -> rope_scaling, plus the family's switches (fixed ones from the table, settable
    ones by the same key: attention_bias, sliding_window); ``seq_length`` is set to
    max_position_embeddings (a run YAML sets its own). ``eos_token_id`` lists keep their first id;
    ``pad_token_id`` null -> 0.

    Raises MsllmError naming ``where`` and the key: an unknown family, a missing or non-integer
    size, a feature msllm does not implement (``mlp_bias``, Gemma 2 soft-capping, Qwen2's
    ``use_sliding_window``, per-layer ``layer_types`` ...), an activation other than the family's,
    an unsupported rope scaling.
    """
    if not isinstance(hf, dict):
        raise MsllmError(f"{where}: expected a JSON object")
    _check_unsupported(hf, where)
    model_type, archs = hf.get("model_type"), hf.get("architectures")
    if model_type not in FAMILIES or (archs is not None and archs != [FAMILIES[model_type].architecture]):
        known = ", ".join(f"{k} ({f.architecture})" for k, f in FAMILIES.items())
        raise MsllmError(f"{where}: unsupported architecture (model_type={model_type!r}, architectures={archs!r}); "
                         f"msllm runs {known}")
    fam = FAMILIES[model_type]

    def need_int(key, default=None):
        value = hf.get(key)
        value = default if value is None else value
        if value is None or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MsllmError(f"{where}: {key} must be a positive integer, got {value!r}")
        return value

    heads = need_int("num_attention_heads")
    hidden = need_int("hidden_size")
    kv = need_int("num_key_value_heads", heads)
    switches = fam.fixed_values(hidden)
    act = hf.get("hidden_act", hf.get("hidden_activation")) or switches.get("hidden_act", "silu")
    if act == "gelu" and model_type == "gemma":
        act = "gelu_pytorch_tanh"  # transformers' GemmaConfig does the same: the legacy name meant tanh
    if act != switches.get("hidden_act", "silu"):
        raise MsllmError(f"{where}: hidden_act={act!r}; a {model_type} model's MLP uses "
                         f"{switches.get('hidden_act', 'silu')!r}")
    switches["hidden_act"] = act
    if hf.get("attention_bias"):
        if "attention_bias" not in fam.settable:
            raise MsllmError(f"{where}: attention_bias=true is not part of a {model_type} model")
        switches["attention_bias"] = True
    if "sliding_window" in fam.settable and hf.get("sliding_window") is not None:
        switches["sliding_window"] = need_int("sliding_window")
    moe = _hf_moe(hf, model_type, fam.moe, need_int, where)
    head_dim = hf.get("head_dim")
    if head_dim is not None:
        head_dim = need_int("head_dim")
    theta, scaling = _hf_rope(hf, where)
    max_pos = need_int("max_position_embeddings", 2048)
    eos = hf.get("eos_token_id", 2)
    if isinstance(eos, list):
        eos = eos[0] if eos else 2
    pad = hf.get("pad_token_id")
    bos = hf.get("bos_token_id")
    try:
        return LlamaConfig(
            vocab_size=need_int("vocab_size"), hidden_size=hidden, num_layers=need_int("num_hidden_layers"),
            num_heads=heads, n_kv_heads=kv, head_dim=head_dim, intermediate_size=need_int("intermediate_size"),
            seq_length=max_pos, max_position_embeddings=max_pos,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", fam.tied_default)), model_type=model_type,
            bos_token_id=int(bos if bos is not None else 1),
            eos_token_id=int(eos if eos is not None else 2), pad_token_id=int(pad if pad is not None else 0),
            initializer_range=float(hf.get("initializer_range", 0.02)), moe_config=moe, **switches)
    except MsllmError as exc:
        raise MsllmError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise MsllmError(f"{where}: {exc}") from None


def _hf_moe(hf: dict, model_type: str, is_moe: bool, need_int, where: str):
    """The :class:`MoeConfig` of an MoE family's ``config.json`` (None for a dense family, which
    must not name experts). Keys: Mixtral ``num_local_experts``, Qwen-MoE ``num_experts`` (or
    ``num_local_experts``);
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
    ``norm_topk_prob`` (Mixtral: always), ``decoder_sparse_step``, ``mlp_only_layers``,
    ``router_aux_loss_coef``."""
    # Mixtral writes num_local_experts; Qwen-MoE releases num_experts (transformers 5 maps Qwen3-MoE's
    # to num_local_experts and saves that name)
    count_key = "num_local_experts" if model_type == "mixtral" or hf.get("num_experts") is None else "num_experts"
    if not is_moe:
        for key in ("num_experts", "num_local_experts"):
            if hf.get(key):
                raise MsllmError(f"{where}: {key}={hf[key]!r} in a {model_type!r} config: a dense family "
                                 f"has no experts (msllm's MoE families: mixtral, qwen2_moe, qwen3_moe)")
        return None
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise MsllmError(f"{where}: mlp_only_layers must be a list of layer indices, got {only!r}")
    return MoeConfig(expert_num=need_int(count_key), num_experts_chosen=need_int("num_experts_per_tok"),
                     moe_intermediate_size=hf.get("moe_intermediate_size"),
                     shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
                     if model_type == "qwen2_moe" else 0,
                     norm_topk_prob=True if model_type == "mixtral" else bool(hf.get("norm_topk_prob", False)),
                     aux_loss_factor=float(hf.get("router_aux_loss_coef", 0.001)),
                     decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1), mlp_only_layers=list(only))


def msllm_config_to_hf(cfg: LlamaConfig, dtype: str = "float32") -> dict:
    """msllm :class:`LlamaConfig` -> HF ``config.json`` dict of its family (``cfg.model_type``:
    ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` ...).

    Writes both the legacy ``rope_theta``/``rope_scaling``/``torch_dtype`` keys (transformers 4)
    and ``rope_parameters``/``dtype`` (transformers 5); both versions load it.
    Raises MsllmError naming the switch when ``cfg`` cannot be written as its ``model_type``
    (:func:`msllm.models.llama.families.check_representable`).
    """
    switches = {k: getattr(cfg, k) for k in SWITCH_DEFAULTS}
    check_representable(cfg.model_type, switches, cfg.hidden_size, "model_config", cfg.moe_config is not None)
    scaling = None
    rope_parameters = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        spec = check_rope_scaling(cfg.rope_scaling, "model_config.rope_scaling")
        kind, keys = spec.pop("type"), spec
        scaling = {"type": kind, "rope_type": kind, **keys}
        rope_parameters = {"rope_type": kind, "rope_theta": float(cfg.rope_theta), **keys}
    out = {
        "architectures": [FAMILIES[cfg.model_type].architecture],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_positions,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    settable = FAMILIES[cfg.model_type].settable   # the family table says which keys its config.json has
    if "attention_bias" in settable:
        out["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        out.update(mlp_bias=False, pretraining_tp=1)
    if cfg.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    if "sliding_window" in settable:
        out["sliding_window"] = cfg.sliding_window
    m = cfg.moe_config
    if m is not None and cfg.model_type == "mixtral" and not m.norm_topk_prob:
        raise MsllmError("model_config.moe_config.norm_topk_prob=False but Mixtral always renormalises the top k")
    if m is not None:
        out.update({"num_local_experts" if cfg.model_type == "mixtral" else "num_experts": m.expert_num,
                    "num_experts_per_tok": m.num_experts_chosen, "router_aux_loss_coef": m.aux_loss_factor,
                    "output_router_logits": False})
        if cfg.model_type != "mixtral":
            out.update(moe_intermediate_size=cfg.expert_size, norm_topk_prob=m.norm_topk_prob,
                       decoder_sparse_step=m.decoder_sparse_step, mlp_only_layers=list(m.mlp_only_layers))
        if cfg.model_type == "qwen2_moe":
            out["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size
    return out


YAML_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "n_kv_heads", "head_dim", "intermediate_size",
             "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
             "model_type", *SWITCH_DEFAULTS, "bos_token_id", "eos_token_id", "pad_token_id")


def model_config_yaml(cfg: LlamaConfig) -> str:
    """The ``model: model_config:`` block of a run YAML for ``cfg`` (shape keys only)."""
    import yaml

    d = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
         "num_heads": cfg.num_heads, "n_kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
         "intermediate_size": cfg.ffn_size,
         "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": float(cfg.rope_theta),
         "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_positions,
         "tie_word_embeddings": cfg.tie_word_embeddings, "model_type": cfg.model_type,
         **{k: getattr(cfg, k) for k in SWITCH_DEFAULTS if getattr(cfg, k) != SWITCH_DEFAULTS[k]},
         "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    if d["rope_scaling"] is None:
        del d["rope_scaling"]
    if cfg.moe_config is not None:
        import dataclasses

        d["moe_config"] = dataclasses.asdict(cfg.moe_config)
    if d["head_dim"] == cfg.hidden_size // cfg.num_heads:
        del d["head_dim"]  # the default; written only when it differs
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
