"""MindFormers-named LLaMA checkpoints: renaming to msllm names and the ``qkv_concat`` layout.

Names: :data:`msllm.models.llama.names.PARAM_TABLE` (MindFormers column). MindFormers' HF
converter is a pure rename (no transpose, no permutation): its ``Linear`` keeps ``(out, in)``
weights and its rotary embedding is HF's rotate_half, so values copy unchanged. (Its *Meta*
converter permutes wq/wk; very old MindFormers checkpoints that kept Meta's interleaved rotary
layout cannot be told apart by name and are not supported.)

``qkv_concat: True`` checkpoints hold one ``attention.w_qkv.weight`` and one
``feed_forward.w_gate_hidden.weight`` per layer, written by ``convert_qkv_concat_weight`` in
``mindformers/models/llama/convert_weight.py`` through ``qkv_concat_hf2mg`` / ``ffn_concat_hf2mg``
of ``mindformers/utils/convert_utils.py`` (mindspore-lab/mindformers, introduced in commit
aad227b425f6831618d339ee4c46aa57669515fc, 2024-11; unchanged at
6ffdebbf16f78324c6b7d4e6a936dd53ebf13b93, the code MindFormers 1.9.0 ships). Their row order
is Megatron's, grouped by key/value head, not a plain concatenation:

* ``w_qkv`` ((H + 2K) * D, C), H query heads, K key/value heads, D head dim, R = H / K: for each
  kv group g = 0..K-1, the R query heads of the group (R * D rows: q rows g*R*D .. (g+1)*R*D-1),
  then k head g (D rows), then v head g (D rows). In numpy: ``w.reshape(K, (R + 2) * D, C)``
  holds ``[q.reshape(K, R*D, C), k.reshape(K, D, C), v.reshape(K, D, C)]`` along axis 1. With
  MHA (R = 1) that is q_h, k_h, v_h per head.
* ``w_gate_hidden`` (2F, C): gate (w1) and up (w3) rows interleaved, row 2j = gate row j, row
  2j + 1 = up row j (``w.reshape(F, 2, C)``).

Checkpoints written by MindFormers before that commit concatenated plainly ([q; k; v], [w1; w3]);
they have the same names and shapes and would load wrong: msllm reads the current layout only.
Optimizer moments of a fused weight (``adam_m.*.w_qkv.weight``) share its layout and are split
the same way.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from msllm.errors import MsllmError
from msllm.models.llama.names import (FUSED_PARTS, GATE_HIDDEN_CONCAT, OPTIMIZER_STATE_PREFIXES, QKV_CONCAT,
                                      fused_template, is_mindformers_name, is_msllm_only_name, mindformers_to_msllm_name,
                                      msllm_to_mindformers_name, split_state_prefix)


# MindFormers train-step entries with another msllm name: its loss-scale Parameter is
# ``scale_sense`` (``mindformers/wrapper/wrapper.py``, ``MFTrainOneStepCell`` on MindSpore's
# ``TrainOneStepWithLossScaleCell``), msllm's TrainStep calls it ``loss_scale``.
TRAINER_RENAMES = {"scale_sense": "loss_scale"}


# ---------------------------------------------------------------------------------------------
# qkv_concat row layout (numpy)


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, num_heads: int, kv_heads: int) -> np.ndarray:
    """(H*D, C), (K*D, C), (K*D, C) -> MindFormers' ``w_qkv`` ((H + 2K) * D, C), grouped by kv
    head (``qkv_concat_hf2mg``). Works for any trailing shape (biases: 1-D)."""
    d = k.shape[0] // kv_heads
    rep = num_heads // kv_heads
    tail = q.shape[1:]
    groups = np.concatenate([q.reshape((kv_heads, rep * d) + tail), k.reshape((kv_heads, d) + tail),
                             v.reshape((kv_heads, d) + tail)], axis=1)
    return np.ascontiguousarray(groups.reshape(((num_heads + 2 * kv_heads) * d,) + tail))


def split_qkv(w: np.ndarray, num_heads: int, kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of :func:`fuse_qkv`: MindFormers ``w_qkv`` -> (q, k, v), each contiguous.

    Raises ValueError if the rows do not divide into ``num_heads + 2 * kv_heads`` heads."""
    rows, tail = w.shape[0], w.shape[1:]
    n = num_heads + 2 * kv_heads
    if num_heads % kv_heads or rows % n:
        raise ValueError(f"{rows} rows do not split into {num_heads} query + 2 x {kv_heads} key/value heads")
    d, rep = rows // n, num_heads // kv_heads
    groups = w.reshape((kv_heads, (rep + 2) * d) + tail)
    q = groups[:, :rep * d].reshape((num_heads * d,) + tail)
    k = groups[:, rep * d:(rep + 1) * d].reshape((kv_heads * d,) + tail)
    v = groups[:, (rep + 1) * d:].reshape((kv_heads * d,) + tail)
    return np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)


def fuse_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """(F, C), (F, C) -> MindFormers' ``w_gate_hidden`` (2F, C), rows interleaved
    (``ffn_concat_hf2mg``)."""
    f = gate.shape[0]
    return np.ascontiguousarray(np.stack([gate, up], axis=1).reshape((2 * f,) + gate.shape[1:]))


def split_gate_up(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`fuse_gate_up`: (2F, C) -> (gate, up). ValueError for an odd row count."""
    if w.shape[0] % 2:
        raise ValueError(f"{w.shape[0]} rows do not split into two interleaved halves (w1, w3)")
    pairs = w.reshape((w.shape[0] // 2, 2) + w.shape[1:])
    return np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])


def fused_parts(name: str, shape: tuple, num_heads: int, kv_heads: int, hidden_size: int) -> Optional[list]:
    """For a ``qkv_concat`` entry ``name`` of ``shape`` (optimizer prefix allowed):
    ``[(msllm name, part shape), ...]`` in the order :func:`split_fused` returns the parts;
    None for any other name.

    Raises ValueError when ``shape`` is not the fused shape the model config implies
    (w_qkv ((H + 2K) * D, C), w_gate_hidden (2F, C) with C = ``hidden_size``).
    """
    found = fused_template(name)
    if found is None:
        return None
    template, i = found
    prefix = split_state_prefix(name)[0]
    names = [prefix + t.format(i=i) for t in FUSED_PARTS[template]]
    if len(shape) != 2 or shape[1] != hidden_size:
        raise ValueError(f"{name} has shape {list(shape)}; expected (rows, {hidden_size})")
    if template == QKV_CONCAT:
        d = hidden_size // num_heads
        if shape[0] != (num_heads + 2 * kv_heads) * d:
            raise ValueError(f"{name} has {shape[0]} rows; {num_heads} query + 2 x {kv_heads} key/value heads "
                             f"of {d} imply {(num_heads + 2 * kv_heads) * d}")
        return [(names[0], (num_heads * d, hidden_size)), (names[1], (kv_heads * d, hidden_size)),
                (names[2], (kv_heads * d, hidden_size))]
    if shape[0] % 2:
        raise ValueError(f"{name} has an odd row count {shape[0]}; expected 2 x intermediate size")
    return [(names[0], (shape[0] // 2, hidden_size)), (names[1], (shape[0] // 2, hidden_size))]


def split_fused(name: str, w: np.ndarray, num_heads: int, kv_heads: int) -> tuple[np.ndarray, ...]:
    """The msllm parts of fused entry ``name`` (see :func:`fused_parts` for their names)."""
    template = fused_template(name)[0]
    return split_qkv(w, num_heads, kv_heads) if template == QKV_CONCAT else split_gate_up(w)


# ---------------------------------------------------------------------------------------------
# Whole checkpoints


def has_fused(names) -> bool:
    """True if any entry name is a ``qkv_concat`` tensor."""
    return any(fused_template(n) for n in names)


def msllm_name_map(names, source: str) -> dict[str, str]:
    """``{name: msllm name}`` for checkpoint entry ``names``: MindFormers names are renamed when
    the checkpoint uses MindFormers naming, everything else maps to itself (fused ``qkv_concat``
    entries too: :func:`split_fused_params` splits them).

    Raises MsllmError naming ``source`` and one name of each kind if msllm and MindFormers weight
    names are mixed.
    """
    names = list(names)
    mf = [n for n in names if is_mindformers_name(n)]
    if not mf:
        return {n: n for n in names}
    ours = [n for n in names if is_msllm_only_name(n)]
    if ours:
        raise MsllmError(f"{source}: mixes MindFormers names (e.g. {mf[0]}) with msllm names "
                         f"(e.g. {ours[0]}); expected one naming")
    return {n: (mindformers_to_msllm_name(n) or TRAINER_RENAMES.get(n, n)) for n in names}


def split_fused_params(params: dict, model_config, source: str) -> dict:
    """Replace every ``qkv_concat`` entry of ``params`` (``{name: value}``, values numpy arrays or
    MindSpore Tensors/Parameters) by its msllm parts, split per ``model_config`` (a
    :class:`LlamaConfig`); other entries are kept. Parts are Parameters when the entry was one.

    Raises MsllmError naming ``source`` and the entry for a shape the config does not imply,
    or a part that another entry already provides.
    """
    mc = model_config
    out: dict = {}
    for name, value in params.items():
        try:
            parts = fused_parts(name, tuple(getattr(value, "shape", ())), mc.num_heads, mc.kv_heads, mc.hidden_size)
        except ValueError as exc:
            raise MsllmError(f"{source}: {exc} (MindFormers qkv_concat checkpoint of another model shape?)") from None
        if parts is None:
            items = [(name, value)]
        else:
            arrays = split_fused(name, _numpy(value), mc.num_heads, mc.kv_heads)
            items = [(n, _like(value, a, n)) for (n, _), a in zip(parts, arrays)]
        for n, v in items:
            if n in out:
                raise MsllmError(f"{source}: two entries provide {n} (the second is {name})")
            out[n] = v
    return out


def to_msllm_names(params: dict, source: str, model_config=None) -> dict:
    """Rename a MindFormers-named checkpoint dict to msllm names; return an msllm-named dict as is.

    Args:
        params: ``{name: value}`` as ``mindspore.load_checkpoint`` returns (values Parameter /
            Tensor; numpy arrays work too). Non-weight entries (``global_step``, ``epoch_num``,
            ...) keep their names, except MindFormers' ``scale_sense`` -> ``loss_scale``;
            optimizer states ``adam_m.*``/``adam_v.*`` are renamed like their parameters.
        source: the checkpoint path, for messages.
        model_config: a :class:`LlamaConfig`; needed to split ``qkv_concat`` entries
            (``attention.w_qkv``, ``feed_forward.w_gate_hidden``, see the module docstring).
            Without it those entries are returned unsplit under their MindFormers names
            (:func:`msllm.formats.loading.load_into` splits them with the network's config).

    Returns:
        ``params`` itself when it has no MindFormers names, else a new dict (``Parameter`` values
        of renamed entries are not copied; their ``.name`` is not used by ``load_param_into_net``).

    Raises:
        MsllmError: mixed naming, a name that two entries rename to, or a fused tensor whose
            shape the config does not imply; the message names ``source`` and the tensor.
    """
    if not any(is_mindformers_name(n) for n in params):
        return params
    mapping = msllm_name_map(params, source)
    out: dict = {}
    for old, value in params.items():
        new = old if fused_template(old) else mapping[old]
        if new in out:
            raise MsllmError(f"{source}: two entries map to {new} (the second is {old})")
        out[new] = value
    return split_fused_params(out, model_config, source) if model_config is not None else out


def _numpy(value) -> np.ndarray:
    return value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)


def _like(value, array: np.ndarray, name: str):
    """``array`` as the same kind of object as ``value`` (Parameter / Tensor / numpy)."""
    kind = type(value).__name__
    if kind in ("Parameter", "Tensor"):
        import mindspore as ms

        tensor = ms.Tensor(array, dtype=value.dtype)
        if kind == "Parameter":
            return ms.Parameter(tensor, name=name, requires_grad=value.requires_grad)
        return tensor
    return array


def to_mindformers_params(params: dict, model_config, qkv_concat: bool = False) -> dict:
    """The inverse direction, for writing MindFormers checkpoints (tests, benchmarks):
    ``{msllm name: numpy array}`` -> ``{MindFormers name: numpy array}``, fusing q/k/v and
    gate/up per layer (and their ``adam_m.``/``adam_v.`` moments) when ``qkv_concat``."""
    out = {msllm_to_mindformers_name(n) or n: v for n, v in params.items()}
    if not qkv_concat:
        return out
    mc = model_config
    for prefix in ("",) + OPTIMIZER_STATE_PREFIXES:
        for i in range(mc.num_layers):
            for template, fuse in ((QKV_CONCAT, lambda *a: fuse_qkv(*a, mc.num_heads, mc.kv_heads)),
                                   (GATE_HIDDEN_CONCAT, fuse_gate_up)):
                parts = [prefix + msllm_to_mindformers_name(t.format(i=i)) for t in FUSED_PARTS[template]]
                if all(p in out for p in parts):
                    out[prefix + template.format(i=i)] = fuse(*[out.pop(p) for p in parts])
    return out


__all__ = ["fuse_qkv", "split_qkv", "fuse_gate_up", "split_gate_up", "fused_parts", "split_fused", "has_fused",
           "msllm_name_map", "split_fused_params", "to_msllm_names", "to_mindformers_params"]
