"""The one table of LLaMA parameter names (msllm <-> Hugging Face <-> Meta <-> MindFormers) and the
one definition of every parameter's shape.

Everything that names or sizes a weight uses this module: checkpoint loading
(:mod:`msllm.training.checkpoint`), conversion (:mod:`msllm.convert`), MindFormers checkpoints
(:mod:`msllm.formats.mindformers`) and parallel layouts (:mod:`msllm.parallel.param_layout`).
Pure Python: no MindSpore, no numpy.

Sources of the columns:

* msllm: the parameters of :class:`msllm.models.llama.model.LlamaForCausalLM` (HF's names,
  except the embedding, a MindSpore ``embedding_table``).
* Hugging Face: ``transformers/models/llama/modeling_llama.py`` (``LlamaForCausalLM.state_dict``).
* Meta: ``consolidated.NN.pth`` of ``facebookresearch/llama`` (``model.py``: ``tok_embeddings``,
  ``layers.{i}.attention.w{q,k,v,o}``, ``feed_forward.w{1,2,3}``, ``attention_norm``,
  ``ffn_norm``, ``norm``, ``output``).
* MindFormers: ``mindformers/models/llama/convert_weight.py`` (``name_replace``) and the cells of
  ``llama.py`` / ``llama_transformer.py`` (``tok_embeddings.embedding_weight``, ``norm_out``), in
  mindspore-lab/mindformers at commit 6ffdebbf16f78324c6b7d4e6a936dd53ebf13b93. With
  ``qkv_concat: True`` MindFormers stores ``attention.w_qkv.weight`` and
  ``feed_forward.w_gate_hidden.weight`` instead of wq/wk/wv and w1/w3; their row layout is in
  :mod:`msllm.formats.mindformers`.

Optimizer states repeat their parameter's name behind a prefix (``adam_m.`` / ``adam_v.``, the
names MindSpore's ``AdamWeightDecay`` gives its moments, also in MindFormers checkpoints).
"""

from __future__ import annotations

import re
from typing import Optional

# (msllm, Hugging Face, Meta consolidated.*.pth, MindFormers). ``{i}`` is the layer index.
PARAM_TABLE: tuple[tuple[str, str, Optional[str], Optional[str]], ...] = (
    ("model.embed_tokens.embedding_table", "model.embed_tokens.weight", "tok_embeddings.weight",
     "model.tok_embeddings.embedding_weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight",
     "layers.{i}.attention.wq.weight", "model.layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
     "layers.{i}.attention.wk.weight", "model.layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight",
     "layers.{i}.attention.wv.weight", "model.layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight",
     "layers.{i}.attention.wo.weight", "model.layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight",
     "layers.{i}.feed_forward.w1.weight", "model.layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight",
     "layers.{i}.feed_forward.w3.weight", "model.layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight",
     "layers.{i}.feed_forward.w2.weight", "model.layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight",
     "layers.{i}.attention_norm.weight", "model.layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight",
     "layers.{i}.ffn_norm.weight", "model.layers.{i}.ffn_norm.weight"),
    ("model.norm.weight", "model.norm.weight", "norm.weight", "model.norm_out.weight"),
    ("lm_head.weight", "lm_head.weight", "output.weight", "lm_head.weight"),
    # family switches (msllm/models/llama/families.py): biases (Qwen2, ``attention_bias``) and
    # Qwen3's per-head q/k norms; Meta's checkpoints have none (None = no such name), MindFormers'
    # LLaMA cells name the biases beside their weights (``qkv_has_bias``) and have no q/k norm
    ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.q_proj.bias", None,
     "model.layers.{i}.attention.wq.bias"),
    ("model.layers.{i}.self_attn.k_proj.bias", "model.layers.{i}.self_attn.k_proj.bias", None,
     "model.layers.{i}.attention.wk.bias"),
    ("model.layers.{i}.self_attn.v_proj.bias", "model.layers.{i}.self_attn.v_proj.bias", None,
     "model.layers.{i}.attention.wv.bias"),
    ("model.layers.{i}.self_attn.o_proj.bias", "model.layers.{i}.self_attn.o_proj.bias", None,
     "model.layers.{i}.attention.wo.bias"),
    ("model.layers.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", None, None),
    ("model.layers.{i}.self_attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", None, None),
    # mixture of experts (msllm/models/llama/moe.py), as transformers 5 names and stores them: the
    # router (E, C), every expert's gate and up rows fused (E, 2I, C) and down (E, C, I), Qwen2-MoE's
    # shared expert and its gate (1, C)
    ("model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate.weight", None, None),
    ("model.layers.{i}.mlp.experts.gate_up_proj", "model.layers.{i}.mlp.experts.gate_up_proj", None, None),
    ("model.layers.{i}.mlp.experts.down_proj", "model.layers.{i}.mlp.experts.down_proj", None, None),
    ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
     None, None),
    ("model.layers.{i}.mlp.shared_expert.up_proj.weight", "model.layers.{i}.mlp.shared_expert.up_proj.weight",
     None, None),
    ("model.layers.{i}.mlp.shared_expert.down_proj.weight", "model.layers.{i}.mlp.shared_expert.down_proj.weight",
     None, None),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "model.layers.{i}.mlp.shared_expert_gate.weight", None, None),
)
NAMINGS = ("msllm", "hf", "meta", "mindformers")

# MindFormers ``qkv_concat: True`` tensors (one per layer): [msllm parts it holds]
QKV_CONCAT = "model.layers.{i}.attention.w_qkv.weight"
GATE_HIDDEN_CONCAT = "model.layers.{i}.feed_forward.w_gate_hidden.weight"
FUSED_PARTS = {
    QKV_CONCAT: ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
                 "model.layers.{i}.self_attn.v_proj.weight"),
    GATE_HIDDEN_CONCAT: ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
}

# The one list of optimizer-state prefixes (AdamW first and second moments).
OPTIMIZER_STATE_PREFIXES = ("adam_m.", "adam_v.")
# Entries of a train-step checkpoint that are not model weights. msllm's trainer writes
# global_step, loss_scale, epoch_num, step_num and the moments; ``scale_sense`` and
# ``accu_grads.*`` are MindFormers' loss scale and gradient-accumulation buffers.
TRAINER_ENTRIES = frozenset({"global_step", "learning_rate", "loss_scale", "current_iterator_step",
                             "last_overflow_iterator_step", "epoch_num", "step_num", "scale_sense"})
TRAINER_PREFIXES = OPTIMIZER_STATE_PREFIXES + ("accu_grads.",)


def template_regex(template: str) -> re.Pattern:
    """``"model.layers.{i}.x"`` -> a regex matching it with any layer index (group ``i``)."""
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_REGEX = {col: [(template_regex(row[idx]), row) for row in PARAM_TABLE if row[idx] is not None]
          for idx, col in enumerate(NAMINGS)}
_FUSED_REGEX = [(template_regex(t), t) for t in FUSED_PARTS]


def split_state_prefix(name: str) -> tuple[str, str]:
    """``"adam_m.model.norm.weight"`` -> ``("adam_m.", "model.norm.weight")``; ``("", name)`` for
    a name without an optimizer-state prefix."""
    for prefix in OPTIMIZER_STATE_PREFIXES:
        if name.startswith(prefix):
            return prefix, name[len(prefix):]
    return "", name


def is_optimizer_state(name: str) -> bool:
    """True for ``adam_m.*`` / ``adam_v.*`` entries."""
    return name.startswith(OPTIMIZER_STATE_PREFIXES)


def is_trainer_entry(name: str) -> bool:
    """True for checkpoint entries of a train step that are not weights (``adam_m.*``,
    ``adam_v.*``, ``accu_grads.*``, ``global_step``, ``loss_scale``, ``epoch_num`` ...)."""
    return name in TRAINER_ENTRIES or name.startswith(TRAINER_PREFIXES)


def translate_name(name: str, src: str, dst: str, states: bool = False) -> Optional[str]:
    """Map weight ``name`` from naming ``src`` to naming ``dst`` (each one of :data:`NAMINGS`).

    With ``states``, an optimizer-state prefix (``adam_m.`` ...) is kept in front of the
    translated name. Returns None if ``name`` is not a weight of that naming.
    """
    prefix, base = split_state_prefix(name) if states else ("", name)
    col = NAMINGS.index(dst)
    for regex, row in _REGEX[src]:
        m = regex.match(base)
        if m:
            target = row[col]
            if target is None:
                return None
            return prefix + (target.format(i=m.group("i")) if "i" in regex.groupindex else target)
    return None


def hf_to_msllm_name(name: str) -> Optional[str]:
    """``model.embed_tokens.weight`` -> ``model.embed_tokens.embedding_table``; other HF weights
    map to themselves; None for names that are not LLaMA weights."""
    return translate_name(name, "hf", "msllm")


def msllm_to_hf_name(name: str) -> Optional[str]:
    """Inverse of :func:`hf_to_msllm_name`."""
    return translate_name(name, "msllm", "hf")


def mindformers_to_msllm_name(name: str) -> Optional[str]:
    """``model.layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``
    (optimizer prefixes kept); None if ``name`` is not a MindFormers LLaMA weight name."""
    return translate_name(name, "mindformers", "msllm", states=True)


def msllm_to_mindformers_name(name: str) -> Optional[str]:
    """Inverse of :func:`mindformers_to_msllm_name`; None for names outside the table."""
    return translate_name(name, "msllm", "mindformers", states=True)


def fused_template(name: str) -> Optional[tuple[str, str]]:
    """``(template, layer index)`` if ``name`` (optimizer prefix allowed) is a MindFormers
    ``qkv_concat`` tensor (:data:`QKV_CONCAT` / :data:`GATE_HIDDEN_CONCAT`), else None."""
    base = split_state_prefix(name)[1]
    for regex, template in _FUSED_REGEX:
        m = regex.match(base)
        if m:
            return template, m.group("i")
    return None


def is_mindformers_name(name: str) -> bool:
    """True if ``name`` exists only in MindFormers naming (``lm_head.weight`` is shared)."""
    if fused_template(name):
        return True
    new = mindformers_to_msllm_name(name)
    return new is not None and new != name


def is_msllm_only_name(name: str) -> bool:
    """True if ``name`` is an msllm weight name that MindFormers spells differently."""
    new = msllm_to_mindformers_name(name)
    return new is not None and new != name


def layer_index(name: str) -> Optional[int]:
    """Layer index in ``...layers.{i}...`` names, else None."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """``{msllm name: shape}`` of every weight of ``LlamaForCausalLM(cfg)`` (``cfg`` a
    :class:`msllm.models.llama.config.LlamaConfig`), in checkpoint order.

    Shapes (C hidden, V vocab, F ffn, H heads, K kv heads, D head dim): embedding (V, C);
    q_proj (H*D, C); k_proj / v_proj (K*D, C); o_proj (C, H*D); gate/up (F, C); down (C, F);
    norms (C,); lm_head (V, C), absent when ``tie_word_embeddings``. Linear weights are
    (out, in), as HF and MindFormers store them. Family switches add q/k/v biases (H*D,), (K*D,)
    (``qkv_has_bias`` or ``attention_bias``), the o bias (C,) (``attention_bias``) and q/k norms
    (D,) (``qk_norm``), in the order of HF's ``state_dict``. ``LlamaConfig.num_params`` equals the
    sum of their sizes (tested).
    """
    c, v, f = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size
    hd, kd = cfg.q_size, cfg.kv_size
    attn = {"self_attn.q_proj.weight": (hd, c)}
    if cfg.qkv_bias:
        attn["self_attn.q_proj.bias"] = (hd,)
    attn["self_attn.k_proj.weight"] = (kd, c)
    if cfg.qkv_bias:
        attn["self_attn.k_proj.bias"] = (kd,)
    attn["self_attn.v_proj.weight"] = (kd, c)
    if cfg.qkv_bias:
        attn["self_attn.v_proj.bias"] = (kd,)
    attn["self_attn.o_proj.weight"] = (c, hd)
    if cfg.o_bias:
        attn["self_attn.o_proj.bias"] = (c,)
    if cfg.qk_norm:
        attn["self_attn.q_norm.weight"] = (cfg.head_dim,)
        attn["self_attn.k_norm.weight"] = (cfg.head_dim,)
    norms = {"input_layernorm.weight": (c,), "post_attention_layernorm.weight": (c,)}
    dense = {"mlp.gate_proj.weight": (f, c), "mlp.up_proj.weight": (f, c), "mlp.down_proj.weight": (c, f)}
    moe = {}
    if cfg.moe_config is not None:
        e, i_e, shared = cfg.moe_config.expert_num, cfg.expert_size, cfg.moe_config.shared_expert_intermediate_size
        moe = {"mlp.gate.weight": (e, c), "mlp.experts.gate_up_proj": (e, 2 * i_e, c),
               "mlp.experts.down_proj": (e, c, i_e)}
        if shared:
            moe.update({"mlp.shared_expert.gate_proj.weight": (shared, c), "mlp.shared_expert.up_proj.weight": (shared, c),
                        "mlp.shared_expert.down_proj.weight": (c, shared), "mlp.shared_expert_gate.weight": (1, c)})
    shapes = {"model.embed_tokens.embedding_table": (v, c)}
    for i in range(cfg.num_layers):
        layer = {**attn, **(moe if cfg.is_moe_layer(i) else dense), **norms}
        for suffix, shape in layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    shapes["model.norm.weight"] = (c,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, c)
    return shapes


def is_norm_weight(name: str) -> bool:
    """True for RMSNorm weights (``*layernorm.weight``, ``model.norm.weight``, Qwen3's
    ``self_attn.q_norm.weight`` / ``k_norm.weight``)."""
    return name.endswith(("layernorm.weight", "_norm.weight")) or name == "model.norm.weight"


def is_bias(name: str) -> bool:
    """True for projection biases (``self_attn.q_proj.bias`` ...)."""
    return name.endswith(".bias")


__all__ = ["PARAM_TABLE", "NAMINGS", "QKV_CONCAT", "GATE_HIDDEN_CONCAT", "FUSED_PARTS",
           "OPTIMIZER_STATE_PREFIXES", "TRAINER_ENTRIES", "TRAINER_PREFIXES", "template_regex",
           "split_state_prefix", "is_optimizer_state", "is_trainer_entry", "translate_name",
           "hf_to_msllm_name", "msllm_to_hf_name", "mindformers_to_msllm_name", "msllm_to_mindformers_name",
           "fused_template", "is_mindformers_name", "is_msllm_only_name", "layer_index", "param_shapes",
           "is_norm_weight", "is_bias"]
