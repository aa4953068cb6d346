"""MindFormers LLaMA parameter names <-> msllm names.

Source: MindFormers ``mindformers/models/llama/convert_weight.py`` (``name_replace``, HF -> MindFormers)
and ``convert_reversed.py`` (MindFormers -> HF), and the cells in ``llama.py`` /
``llama_transformer.py`` / ``llama_layer.py`` (``LlamaEmbedding.embedding_weight``,
``LLamaAttention.wq/wk/wv/wo``, ``LlamaFeedForward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``,
``LlamaModel.norm_out``, ``LlamaForCausalLM.lm_head``):

========================================================  =================================================
msllm (= HF, except the embedding)                        MindFormers
========================================================  =================================================
``model.embed_tokens.embedding_table``                    ``model.tok_embeddings.embedding_weight``
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``      ``model.layers.{i}.attention.w{q,k,v,o}.weight``
``model.layers.{i}.mlp.gate_proj.weight``                 ``model.layers.{i}.feed_forward.w1.weight``
``model.layers.{i}.mlp.up_proj.weight``                   ``model.layers.{i}.feed_forward.w3.weight``
``model.layers.{i}.mlp.down_proj.weight``                 ``model.layers.{i}.feed_forward.w2.weight``
``model.layers.{i}.input_layernorm.weight``               ``model.layers.{i}.attention_norm.weight``
``model.layers.{i}.post_attention_layernorm.weight``      ``model.layers.{i}.ffn_norm.weight``
``model.norm.weight``                                     ``model.norm_out.weight``
``lm_head.weight``                                        ``lm_head.weight``
========================================================  =================================================

Layout: the MindFormers HF converter is a pure rename (no transpose, no permutation): its
``Linear`` keeps ``(out, in)`` weights (``transpose_b=True``) and its rotary embedding is HF's
rotate_half (``get_swap_mask`` = ``[[0, I], [-I, 0]]``, ``x @ swap_mask = [-x2, x1]``, with
``emb = concat(freqs, freqs)``), so values copy unchanged. Only its *Meta* converter permutes
wq/wk; ``convert_to_new_ckpt`` there converts old MindFormers checkpoints that still had Meta's
interleaved layout. Those old checkpoints cannot be told apart by name and are not supported.

``qkv_concat=True`` checkpoints hold ``attention.w_qkv.weight`` = concat(wq, wk, wv) and
``feed_forward.w_gate_hidden.weight`` = concat(w1, w3) along rows (``convert_qkv_concat_weight``);
:func:`concat_splits` undoes that. Optimizer states keep their prefix (``adam_m.`` / ``adam_v.``).
"""

from __future__ import annotations

import re
from typing import Optional

MINDFORMERS_TABLE: tuple[tuple[str, str], ...] = (
    # (msllm, MindFormers)
    ("model.embed_tokens.embedding_table", "model.tok_embeddings.embedding_weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "model.layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.ffn_norm.weight"),
    ("model.norm.weight", "model.norm_out.weight"),
    ("lm_head.weight", "lm_head.weight"),
)

QKV_CONCAT = "model.layers.{i}.attention.w_qkv.weight"
GATE_HIDDEN_CONCAT = "model.layers.{i}.feed_forward.w_gate_hidden.weight"

# Prefixes of optimizer states that repeat a parameter name (MindFormers and msllm AdamW).
STATE_PREFIXES = ("adam_m.", "adam_v.")


def _regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_TO_MSLLM = [(_regex(mf), ms) for ms, mf in MINDFORMERS_TABLE]
_TO_MF = [(_regex(ms), mf) for ms, mf in MINDFORMERS_TABLE]
_QKV, _GATE_HIDDEN = _regex(QKV_CONCAT), _regex(GATE_HIDDEN_CONCAT)


def _split_prefix(name: str) -> tuple[str, str]:
    for prefix in STATE_PREFIXES:
        if name.startswith(prefix):
            return prefix, name[len(prefix):]
    return "", name


def _apply(table, name: str) -> Optional[str]:
    prefix, base = _split_prefix(name)
    for regex, target in table:
        m = regex.match(base)
        if m:
            return prefix + (target.format(i=m.group("i")) if "i" in regex.groupindex else target)
    return None


def mindformers_to_msllm_name(name: str) -> Optional[str]:
    """``model.layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``
    (optimizer prefixes kept); None if ``name`` is not a MindFormers LLaMA weight name."""
    return _apply(_TO_MSLLM, name)


def msllm_to_mindformers_name(name: str) -> Optional[str]:
    """Inverse of :func:`mindformers_to_msllm_name`; None for names outside the table."""
    return _apply(_TO_MF, name)


def is_mindformers_name(name: str) -> bool:
    """True if ``name`` exists only in MindFormers naming (``lm_head.weight`` is shared)."""
    base = _split_prefix(name)[1]
    if _QKV.match(base) or _GATE_HIDDEN.match(base):
        return True
    new = mindformers_to_msllm_name(name)
    return new is not None and new != name


def concat_splits(name: str, rows: int, cols: int) -> Optional[list[tuple[str, int, int]]]:
    """For a ``qkv_concat`` tensor ``name`` of shape (rows, cols): ``[(msllm name, row_start,
    row_stop), ...]``; None for other names.

    ``w_qkv``: q has ``cols`` rows (H * D = hidden size), k and v share the rest equally (GQA);
    ``w_gate_hidden``: gate then up, half each. Raises ValueError if the rows do not split.
    """
    prefix, base = _split_prefix(name)
    m = _QKV.match(base)
    if m:
        if (rows - cols) <= 0 or (rows - cols) % 2:
            raise ValueError(f"{name}: {rows} rows do not split into q ({cols}) + 2 equal k/v blocks")
        kv = (rows - cols) // 2
        i = m.group("i")
        return [(f"{prefix}model.layers.{i}.self_attn.q_proj.weight", 0, cols),
                (f"{prefix}model.layers.{i}.self_attn.k_proj.weight", cols, cols + kv),
                (f"{prefix}model.layers.{i}.self_attn.v_proj.weight", cols + kv, rows)]
    m = _GATE_HIDDEN.match(base)
    if m:
        if rows % 2:
            raise ValueError(f"{name}: {rows} rows do not split into two equal halves (w1, w3)")
        i = m.group("i")
        return [(f"{prefix}model.layers.{i}.mlp.gate_proj.weight", 0, rows // 2),
                (f"{prefix}model.layers.{i}.mlp.up_proj.weight", rows // 2, rows)]
    return None


__all__ = ["MINDFORMERS_TABLE", "QKV_CONCAT", "GATE_HIDDEN_CONCAT", "mindformers_to_msllm_name",
           "msllm_to_mindformers_name", "is_mindformers_name", "concat_splits"]
