"""Checkpoint naming detection: MindFormers-named LLaMA checkpoints -> msllm names.

The trainer calls :func:`to_msllm_names` on every checkpoint it loads, so a MindFormers
checkpoint (``model.layers.0.attention.wq.weight`` ...) loads into msllm's network unchanged in
value. The name table and the layout notes are in :mod:`msllm.convert.mindformers`.
"""

from __future__ import annotations

from msllm.convert.mindformers import (concat_splits, is_mindformers_name, mindformers_to_msllm_name,
                                       msllm_to_mindformers_name)
from msllm.errors import MsllmError


def _is_msllm_only(name: str) -> bool:
    """A weight name that MindFormers does not use (so a mix with MindFormers names is an error)."""
    new = msllm_to_mindformers_name(name)
    return new is not None and new != name


def msllm_name_map(names, source: str) -> dict[str, str]:
    """``{name: msllm name}`` for checkpoint entry ``names``: MindFormers names are renamed when
    the checkpoint uses MindFormers naming, everything else maps to itself (``qkv_concat`` tensors
    too; see :func:`to_msllm_names` for splitting them).

    Raises MsllmError naming ``source`` and one name of each kind if msllm and MindFormers weight
    names are mixed.
    """
    names = list(names)
    mf = [n for n in names if is_mindformers_name(n)]
    if not mf:
        return {n: n for n in names}
    ours = [n for n in names if _is_msllm_only(n)]
    if ours:
        raise MsllmError(f"{source}: mixes MindFormers names (e.g. {mf[0]}) with msllm names "
                         f"(e.g. {ours[0]}); expected one naming")
    return {n: (mindformers_to_msllm_name(n) or n) for n in names}


def to_msllm_names(params: dict, source: str) -> dict:
    """Rename a MindFormers-named checkpoint dict to msllm names; return an msllm-named dict as is.

    Args:
        params: ``{name: value}`` as ``mindspore.load_checkpoint`` returns (values Parameter /
            Tensor; numpy arrays work too). Non-weight entries (``global_step``, ``epoch_num``,
            ``scale_sense`` ...) keep their names; optimizer states ``adam_m.*``/``adam_v.*`` are
            renamed like their parameters.
        source: the checkpoint path, for messages.

    Returns:
        ``params`` itself when it has no MindFormers names, else a new dict with the same values
        under msllm names (``Parameter`` values are not copied; their ``.name`` is not used by
        ``load_param_into_net``). ``qkv_concat`` tensors (``attention.w_qkv``,
        ``feed_forward.w_gate_hidden``) are split by rows into q/k/v and gate/up slices.

    Raises:
        MsllmError: mixed naming, a name that two entries rename to, or a concat tensor whose rows
            do not split; the message names ``source`` and the tensor.
    """
    mapping = msllm_name_map(params, source)
    if not any(is_mindformers_name(n) for n in params):
        return params
    out: dict = {}
    for old, value in params.items():
        shape = tuple(getattr(value, "shape", ()))
        try:
            pieces = concat_splits(old, shape[0], shape[1]) if len(shape) == 2 else None
        except ValueError as exc:
            raise MsllmError(f"{source}: {exc}") from None
        items = ([(name, _row_slice(value, a, b, name)) for name, a, b in pieces] if pieces
                 else [(mapping[old], value)])
        for name, v in items:
            if name in out:
                raise MsllmError(f"{source}: two entries map to {name} (the second is {old})")
            out[name] = v
    return out


def _row_slice(value, start: int, stop: int, name: str):
    """Rows ``start:stop`` of ``value``, as a Parameter named ``name`` if ``value`` is one."""
    piece = value[start:stop]
    if type(value).__name__ == "Parameter":
        from mindspore import Parameter

        return Parameter(piece, name=name, requires_grad=value.requires_grad)
    return piece


__all__ = ["to_msllm_names", "msllm_name_map"]
