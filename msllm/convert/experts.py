"""Mixture-of-experts tensors in Hugging Face checkpoint files <-> msllm's fused expert tensors.

msllm (and transformers 5 in memory) hold each MoE layer's experts fused: ``mlp.experts.gate_up_proj``
(E, 2I, C), the gate rows of expert j at ``[j, :I]`` and its up rows at ``[j, I:]``, and
``mlp.experts.down_proj`` (E, C, I). Checkpoint files, on the hub and as transformers 5.24's
``save_pretrained`` writes them (``conversion_mapping.py`` reverses its ``MergeModulelist`` /
``Concatenate`` on save), keep one tensor per expert and projection:

* mixtral: ``model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight`` (gate, (I, C)), ``w3``
  (up), ``w2`` (down, (C, I)); the router ``block_sparse_moe.gate.weight``;
* qwen2_moe / qwen3_moe: ``model.layers.{i}.mlp.experts.{j}.gate_proj.weight``, ``up_proj``,
  ``down_proj``; the router ``mlp.gate.weight``.

Reading accepts either form (per-expert files, or the fused names); writing produces the
per-expert form. Both directions only move bytes, so a round trip is bit-exact.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from msllm.errors import MsllmError
from msllm.formats.dtypes import TensorRef

FUSED_GATE_UP = "model.layers.{i}.mlp.experts.gate_up_proj"
FUSED_DOWN = "model.layers.{i}.mlp.experts.down_proj"
ROUTER = "model.layers.{i}.mlp.gate.weight"

# family -> (router file name, {projection: per-expert file name})
FILE_NAMES = {
    "mixtral": ("model.layers.{i}.block_sparse_moe.gate.weight",
                {"gate": "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight",
                 "up": "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight",
                 "down": "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight"}),
}
for _qwen in ("qwen2_moe", "qwen3_moe"):
    FILE_NAMES[_qwen] = (ROUTER, {"gate": "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
                                  "up": "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
                                  "down": "model.layers.{i}.mlp.experts.{j}.down_proj.weight"})


def _regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)").replace(re.escape("{j}"), r"(?P<j>\d+)")
    return re.compile("^" + pattern + "$")


def fuse_expert_refs(refs: dict[str, TensorRef], model_type: str, n_experts: int) -> dict[str, TensorRef]:
    """``refs`` (HF file name -> tensor) with each layer's per-expert tensors replaced by the two
    fused tensors (named as msllm and transformers name them in memory) and Mixtral's router renamed;
    other tensors pass through. A dense family's refs come back unchanged.

    Raises MsllmError naming the file and tensor: an expert index >= ``n_experts``, a projection
    missing for an expert, experts of different shapes or dtypes."""
    if model_type not in FILE_NAMES:
        return refs
    router, parts = FILE_NAMES[model_type]
    router_re, part_res = _regex(router), {k: _regex(v) for k, v in parts.items()}
    out: dict[str, TensorRef] = {}
    groups: dict[str, dict[tuple[str, int], TensorRef]] = {}
    for name, ref in refs.items():
        m = router_re.match(name)
        if m:
            out[ROUTER.format(i=m.group("i"))] = ref
            continue
        for part, regex in part_res.items():
            m = regex.match(name)
            if m:
                j = int(m.group("j"))
                if j >= n_experts:
                    raise MsllmError(f"{ref.where}: tensor {name} is expert {j}, but the config has {n_experts}")
                groups.setdefault(m.group("i"), {})[(part, j)] = ref
                break
        else:
            out[name] = ref
    for i, got in groups.items():
        for part in parts:
            for j in range(n_experts):
                if (part, j) not in got:
                    where = next(iter(got.values())).where
                    raise MsllmError(f"{where}: tensor {parts[part].format(i=i, j=j)} is missing "
                                     f"(layer {i} has other experts' tensors)")
        first = got[("gate", 0)]
        for key, ref in got.items():
            base = got[("down", 0)] if key[0] == "down" else first
            if tuple(ref.shape) != tuple(base.shape) or ref.dtype != base.dtype:
                raise MsllmError(f"{ref.where}: tensor {parts[key[0]].format(i=i, j=key[1])} has shape "
                                 f"{list(ref.shape)} ({ref.dtype}); expert 0 has {list(base.shape)} ({base.dtype})")
        rows, cols = first.shape
        down = got[("down", 0)]

        def gate_up(got=got):   # (E, 2I, C): expert j's gate rows then its up rows
            return np.stack([np.concatenate([got[("gate", j)].load(), got[("up", j)].load()], 0)
                             for j in range(n_experts)])

        def down_all(got=got):  # (E, C, I)
            return np.stack([got[("down", j)].load() for j in range(n_experts)])
        out[FUSED_GATE_UP.format(i=i)] = TensorRef(FUSED_GATE_UP.format(i=i), (n_experts, 2 * rows, cols),
                                                   first.dtype, first.where, gate_up)
        out[FUSED_DOWN.format(i=i)] = TensorRef(FUSED_DOWN.format(i=i), (n_experts,) + tuple(down.shape),
                                                down.dtype, down.where, down_all)
    return out


def file_tensors(name: str, shape: tuple, model_type: str) -> Optional[list[tuple[str, tuple, callable]]]:
    """The per-expert file tensors an msllm tensor is written as: ``[(HF file name, shape,
    take(array) -> part)]``, or None when ``name`` is written as one tensor (its table name;
    Mixtral's router is renamed by :func:`file_name`)."""
    if model_type not in FILE_NAMES:
        return None
    _, parts = FILE_NAMES[model_type]
    for fused, projections in ((FUSED_GATE_UP, ("gate", "up")), (FUSED_DOWN, ("down",))):
        m = _regex(fused).match(name)
        if not m:
            continue
        i, n_experts = m.group("i"), shape[0]
        out = []
        for j in range(n_experts):
            if fused == FUSED_DOWN:
                out.append((parts["down"].format(i=i, j=j), tuple(shape[1:]), lambda a, j=j: a[j]))
            else:
                half = shape[1] // 2
                out.append((parts["gate"].format(i=i, j=j), (half, shape[2]), lambda a, j=j, h=half: a[j, :h]))
                out.append((parts["up"].format(i=i, j=j), (half, shape[2]), lambda a, j=j, h=half: a[j, h:]))
        return out
    return None


def file_name(name: str, hf_name: str, model_type: str) -> str:
    """The HF file name of a one-tensor weight: Mixtral's router keeps its ``block_sparse_moe``
    name; everything else its table name ``hf_name``."""
    if model_type in FILE_NAMES:
        m = _regex(ROUTER).match(name)
        if m:
            return FILE_NAMES[model_type][0].format(i=m.group("i"))
    return hf_name


__all__ = ["FILE_NAMES", "fuse_expert_refs", "file_tensors", "file_name"]
