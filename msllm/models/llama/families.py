"""The members of the LLaMA family msllm runs, as Hugging Face names them: one table of which
:class:`~msllm.models.llama.config.LlamaConfig` switches each family's ``config.json`` fixes, which
it may set, and which HF keys no msllm switch implements (refused, never dropped).

Pure Python (no MindSpore, no numpy). Sources, transformers 5.24 (the version the parity tests pin):
``models/{llama,qwen2,qwen3,mistral,gemma}/configuration_*.py`` and ``modeling_*.py``:

* llama (``LlamaForCausalLM``): ``attention_bias`` (q, k, v and o), ``head_dim``;
* qwen2 (``Qwen2ForCausalLM``, also Qwen2.5): bias on q, k, v (hard-coded in ``Qwen2Attention``),
  none on o; ``use_sliding_window`` / ``max_window_layers`` (sliding window on some layers only);
* qwen3 (``Qwen3ForCausalLM``): RMSNorm over each head of q and k before rotary (``q_norm``,
  ``k_norm``), explicit ``head_dim``, ``attention_bias``;
* mistral (``MistralForCausalLM``): ``sliding_window`` (v0.1: 4096; later versions null), ``head_dim``;
* gemma (``GemmaForCausalLM``): RMSNorm ``x * (1 + w)`` (``GemmaRMSNorm``), GeGLU with the tanh
  approximation (``gelu_pytorch_tanh``), embeddings times ``sqrt(hidden_size)`` in the weights'
  dtype (``GemmaTextScaledWordEmbedding``), explicit ``head_dim``, tied embeddings by default;
* mixture of experts (``moe``: a ``moe_config``, :mod:`msllm.models.llama.moe`): mixtral
  (``MixtralForCausalLM``: top-k renormalised, Mistral's ``sliding_window``), qwen3_moe
  (``Qwen3MoeForCausalLM``: Qwen3's attention, ``norm_topk_prob``, ``mlp_only_layers``,
  ``decoder_sparse_step``), qwen2_moe (``Qwen2MoeForCausalLM``: Qwen2's attention and a shared
  expert with a sigmoid gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from msllm.errors import MsllmError

# The switches and their plain-LLaMA values (the LlamaConfig defaults).
SWITCH_DEFAULTS = {"qkv_has_bias": False, "attention_bias": False, "qk_norm": False, "sliding_window": None,
                   "rms_norm_offset": 0.0, "hidden_act": "silu", "embedding_multiplier": 1.0}
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Family:
    """One HF family: ``architecture`` (``config.json`` ``architectures``), ``fixed`` switches the
    family always has (``"sqrt_hidden"``: the square root of hidden_size), ``settable`` switches its
    ``config.json`` may set (by the same key name) and ``tied_default`` (``tie_word_embeddings``
    when the key is absent)."""

    architecture: str
    fixed: tuple[tuple[str, object], ...] = ()
    settable: tuple[str, ...] = ()
    tied_default: bool = False
    moe: bool = False

    def fixed_values(self, hidden_size: int) -> dict:
        return {k: (float(math.sqrt(hidden_size)) if v == "sqrt_hidden" else v) for k, v in self.fixed}


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", settable=("attention_bias",)),
    "qwen2": Family("Qwen2ForCausalLM", fixed=(("qkv_has_bias", True),)),
    "qwen3": Family("Qwen3ForCausalLM", fixed=(("qk_norm", True),), settable=("attention_bias",)),
    "mistral": Family("MistralForCausalLM", settable=("sliding_window",)),
    "gemma": Family("GemmaForCausalLM", fixed=(("rms_norm_offset", 1.0), ("hidden_act", "gelu_pytorch_tanh"),
                                               ("embedding_multiplier", "sqrt_hidden")),
                    settable=("attention_bias",), tied_default=True),
    "mixtral": Family("MixtralForCausalLM", settable=("sliding_window",), moe=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", fixed=(("qk_norm", True),), settable=("attention_bias",), moe=True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", fixed=(("qkv_has_bias", True),), moe=True),
}
ARCHITECTURES = {f.architecture: name for name, f in FAMILIES.items()}

# HF config keys of features msllm does not implement, with the value that means "not used";
# any other value is refused naming the key (Gemma 2 soft-capping, Qwen2's per-layer window ...).
UNSUPPORTED_KEYS = {
    "attn_logit_softcapping": None, "final_logit_softcapping": None,  # Gemma 2 / 3
    "use_sliding_window": False,       # Qwen2 / Qwen3: a window on the layers above max_window_layers
    "mlp_bias": False,                 # LlamaConfig
    "partial_rotary_factor": 1.0,      # rotary on a part of each head only
    "query_pre_attn_scalar": None,     # Gemma 2: attention scale other than 1/sqrt(head_dim)
    "router_jitter_noise": 0.0,        # Mixtral: multiplicative noise on the router input in training
}


def family(model_type: str, where: str) -> Family:
    """The :class:`Family` of ``model_type``; MsllmError naming it and the known ones otherwise."""
    if model_type not in FAMILIES:
        raise MsllmError(f"{where}: model_type {model_type!r} is not a family msllm runs; expected one of "
                         f"{', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def check_representable(model_type: str, switches: dict, hidden_size: int, where: str, moe: bool = False) -> None:
    """Raise MsllmError naming the switch if ``switches`` (switch -> value) cannot be written as
    ``model_type``'s HF config: a fixed switch with another value, or a switch the family does not
    have set away from its plain-LLaMA value; ``moe`` (a ``moe_config`` is set) must match the
    family's kind."""
    fam = family(model_type, where)
    if moe != fam.moe:
        raise MsllmError(f"{where}: model_type {model_type!r} is a {'mixture-of-experts' if fam.moe else 'dense'} "
                         f"family but moe_config is {'not ' if not moe else ''}set")
    fixed = fam.fixed_values(hidden_size)
    for key, value in switches.items():
        if key in fixed:
            want = fixed[key]
            same = math.isclose(value, want, rel_tol=1e-6) if isinstance(want, float) else value == want
            if not same:
                raise MsllmError(f"{where}: {key}={value!r} but model_type {model_type!r} always has {want!r}")
        elif key not in fam.settable and value != SWITCH_DEFAULTS[key]:
            owners = [n for n, f in FAMILIES.items() if key in f.settable or key in dict(f.fixed)]
            raise MsllmError(f"{where}: {key}={value!r} has no place in a {model_type!r} config.json "
                             f"(families with it: {', '.join(owners)}); set model_config.model_type")


__all__ = ["Family", "FAMILIES", "ARCHITECTURES", "SWITCH_DEFAULTS", "HIDDEN_ACTS", "UNSUPPORTED_KEYS",
           "family", "check_representable"]
