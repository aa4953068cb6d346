"""Which linear modules LoRA adapts, and the names of the adapter parameters. Pure Python.

Module names come from the one name table (:mod:`msllm.models.llama.names`): the LLaMA linear
layers are ``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``model.layers.{i}.mlp.{gate,up,down}_proj``
and ``lm_head`` (absent with tied embeddings); MindFormers calls them
``model.layers.{i}.attention.w{q,k,v,o}``, ``model.layers.{i}.feed_forward.w{1,3,2}``, ``lm_head``.

Adapter parameters are named ``<module>.lora_A.weight`` (r, in) and ``<module>.lora_B.weight``
(out, r) under msllm/HF module names; PEFT stores the same tensors as
``base_model.model.<module>.lora_A.weight`` in ``adapter_model.safetensors``
(``peft.utils.save_and_load.get_peft_model_state_dict``), so the two map 1:1.
"""

from __future__ import annotations

import re
from typing import Iterable

from msllm.errors import MsllmError
from msllm.config_lora import WHERE
from msllm.models.llama.names import msllm_to_mindformers_name, param_shapes

LINEAR_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LORA_A, LORA_B = "lora_A", "lora_B"


def is_linear_module(module: str) -> bool:
    """True for the names of the model's linear layers (msllm/HF naming)."""
    return module == "lm_head" or bool(re.fullmatch(r"model\.layers\.\d+\.(%s)" % "|".join(
        re.escape(s) for s in LINEAR_SUFFIXES), module))


def linear_modules(model_config) -> dict[str, tuple[int, int]]:
    """``{module: (out_features, in_features)}`` of every linear layer of
    ``LlamaForCausalLM(model_config)``, in parameter order."""
    out = {}
    for name, shape in param_shapes(model_config).items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and is_linear_module(module):
            out[module] = tuple(shape)
    return out


def mindformers_module_name(module: str) -> str:
    """``model.layers.0.self_attn.q_proj`` -> ``model.layers.0.attention.wq`` (``lm_head`` stays)."""
    mf = msllm_to_mindformers_name(module + ".weight")
    return mf[: -len(".weight")] if mf else module


def module_keys(module: str) -> tuple[str, ...]:
    """The names ``target_modules`` is matched against: full msllm/HF and MindFormers names and
    their last components."""
    mf = mindformers_module_name(module)
    return (module, mf, module.rsplit(".", 1)[-1], mf.rsplit(".", 1)[-1])


def _fold(indices: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0-3``; ``[0, 2]`` -> ``0,2``; ``[5]`` -> ``5``."""
    s = sorted(set(indices))
    if len(s) > 1 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}-{s[-1]}"
    return ",".join(map(str, s))


def describe_modules(modules: Iterable[str]) -> str:
    """Module names with layer indices folded (for logs and errors): ``model.layers.{0-3}.self_attn.q_proj, lm_head``."""
    groups: dict[str, list[int]] = {}
    for m in modules:
        hit = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", m)
        key, idx = (f"model.layers.{{i}}.{hit.group(2)}", int(hit.group(1))) if hit else (m, -1)
        groups.setdefault(key, []).append(idx)
    return ", ".join(key if idx == [-1] else key.replace("{i}", "{" + _fold(idx) + "}")
                     for key, idx in groups.items())


def match_targets(model_config, target_modules: str, where: str = WHERE) -> list[str]:
    """The linear modules (msllm names, parameter order) whose names ``re.fullmatch``
    ``target_modules`` (see :mod:`msllm.config_lora` for the names tried).

    Raises:
        MsllmError: the regex is invalid, or matches no module (the message lists the available
            modules in both namings).
    """
    try:
        regex = re.compile(target_modules)
    except (re.error, TypeError) as exc:
        raise MsllmError(f"{where}.target_modules={target_modules!r} is not a valid regex: {exc}") from None
    modules = list(linear_modules(model_config))
    chosen = [m for m in modules if any(regex.fullmatch(k) for k in module_keys(m))]
    if not chosen:
        one_layer = [m for m in modules if m.startswith("model.layers.0.")] + \
            [m for m in modules if m == "lm_head"]
        raise MsllmError(
            f"{where}.target_modules={target_modules!r} matches no module of the model; available "
            f"(re.fullmatch against either naming, or the last name component): "
            f"{describe_modules(m.replace('layers.0.', 'layers.{i}.') for m in one_layer)} "
            f"(MindFormers: {describe_modules(mindformers_module_name(m).replace('layers.0.', 'layers.{i}.') for m in one_layer)}), "
            f"i = 0..{model_config.num_layers - 1}; e.g. '.*wq|.*wk|.*wv|.*wo' or '.*q_proj|.*v_proj'")
    return chosen


def adapter_names(module: str) -> tuple[str, str]:
    """``(<module>.lora_A.weight, <module>.lora_B.weight)``."""
    return f"{module}.{LORA_A}.weight", f"{module}.{LORA_B}.weight"


def adapter_shapes(model_config, modules: Iterable[str], rank: int) -> dict[str, tuple[int, int]]:
    """``{adapter parameter name: shape}``: A (r, in) and B (out, r) for each module."""
    lin = linear_modules(model_config)
    out = {}
    for m in modules:
        o, i = lin[m]
        a, b = adapter_names(m)
        out[a], out[b] = (rank, i), (o, rank)
    return out


_ADAPTER = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B)\.weight$")


def split_adapter_name(name: str):
    """``model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``(module, "lora_A")``; None for names
    that are not adapter parameters."""
    m = _ADAPTER.match(name)
    return (m.group("module"), m.group("which")) if m and is_linear_module(m.group("module")) else None


def is_adapter_param(name: str) -> bool:
    """True for ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` of a linear module (not for
    their optimizer states ``adam_m.*`` / ``adam_v.*``)."""
    return split_adapter_name(name) is not None


def exact_target_regex(modules: Iterable[str]) -> str:
    """A ``target_modules`` regex matching exactly ``modules`` (msllm names), e.g. for adapters
    imported from PEFT: ``model\\.layers\\.(0|1)\\.self_attn\\.(q_proj|v_proj)`` style when every
    listed layer has the same set, else an alternation of the full names."""
    modules = list(modules)
    layers: dict[int, set] = {}
    other = []
    for m in modules:
        hit = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", m)
        if hit:
            layers.setdefault(int(hit.group(1)), set()).add(hit.group(2))
        else:
            other.append(m)
    parts = []
    sets = {frozenset(v) for v in layers.values()}
    if len(sets) == 1:
        suffixes = sorted(next(iter(sets)))
        idx = "|".join(str(i) for i in sorted(layers))
        parts.append(rf"model\.layers\.({idx})\.({'|'.join(re.escape(s) for s in suffixes)})")
    else:
        parts += [re.escape(m) for m in modules if m not in other]
    parts += [re.escape(m) for m in other]
    return "|".join(parts)


__all__ = ["LINEAR_SUFFIXES", "LORA_A", "LORA_B", "is_linear_module", "linear_modules", "mindformers_module_name",
           "module_keys", "match_targets", "describe_modules", "adapter_names", "adapter_shapes",
           "split_adapter_name", "is_adapter_param", "exact_target_regex"]
