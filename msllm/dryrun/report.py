"""Reading a dry-run child's output: MindSpore's peak device memory, the collectives of the compiled
graph, and which YAML key a layout error points at.

* Memory: at ``MS_SIMULATION_LEVEL`` 1 MindSpore prints at process exit (its memory adapter's
  ``DeInitialize``; format in mindspore-ai/docs ``tutorials/source_en/debug/dryrun.md``)::

      Used peak memory usage (without fragments): 23716M
      Actual peak memory usage (with fragments): 26244M

  :func:`parse_peak_memory` returns both in MiB (MindSpore's ``M``).
* Collectives: with ``MS_DEV_SAVE_GRAPHS=1`` MindSpore writes its IR per pass; the
  ``*_validate_*.ir`` file is the whole graph after the parallel passes (collectives inserted,
  forward and backward, before backend fusion). A collective node reads e.g.::

      %91(...) = AllReduce(%90) {...} primitive_attrs: {... group_rank_ids: (4, 5), ...}
          # Fullname with scope: (Default/network-.../layers-CellList/2-DecoderLayer/...)

  :func:`collectives` counts them by kind, group size and decoder layer (``None`` = outside
  the layers), and whether the node is in the backward pass (scope under ``Gradients/``).
"""

from __future__ import annotations

import glob
import os
import re
from collections import Counter

COLLECTIVE_KINDS = ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "AllToAll", "Broadcast", "Send",
                    "Receive", "AlltoAllV", "AllGatherV", "ReduceScatterV")
_NODE = re.compile(r"= (" + "|".join(COLLECTIVE_KINDS) + r")\((.*)$")
_RANKS = re.compile(r"group_rank_ids: \(([\d, ]+)\)")
_SCOPE = re.compile(r"# Fullname with scope: \(([^)]*)\)")
_LAYER = re.compile(r"layers-CellList/(\d+)-")
_USED = re.compile(r"Used peak memory usage \(without fragments\): (\d+)M")
_ACTUAL = re.compile(r"Actual peak memory usage \(with fragments\): (\d+)M")


def parse_peak_memory(text: str) -> dict | None:
    """``{"used_peak_mib": int, "actual_peak_mib": int}`` from MindSpore's exit lines, or ``None``
    when the run printed none (level 0, or a failed compile)."""
    used, actual = _USED.findall(text), _ACTUAL.findall(text)
    if not used:
        return None
    return {"used_peak_mib": int(used[-1]), "actual_peak_mib": int(actual[-1]) if actual else None}


def validate_ir(graphs_dir: str) -> str | None:
    """The last ``*_validate_*.ir`` under ``graphs_dir`` (MindSpore writes ``rank_R/NN_validate_XXXX.ir``)."""
    files = sorted(glob.glob(os.path.join(graphs_dir, "**", "*_validate_*.ir"), recursive=True))
    return files[-1] if files else None


_IR_NODE = re.compile(r"^\s+%\d+\(", re.M)
_IR_GRAPH = re.compile(r"^subgraph @", re.M)


def graph_size(ir_text: str) -> dict:
    """The size of a validate IR dump: ``{"ir_bytes", "nodes", "subgraphs"}`` (node lines ``%N(...) =``,
    subgraph headers ``subgraph @name(``). How the compiled graph grows with layers and micro
    batches, and whether a cell marked for reuse (``lazy_inline``) is one subgraph called several
    times or copied at every call (BENCHMARKS.md, "Dry-run")."""
    return {"ir_bytes": len(ir_text.encode("utf-8", errors="replace")), "nodes": len(_IR_NODE.findall(ir_text)),
            "subgraphs": len(_IR_GRAPH.findall(ir_text))}


def collectives(ir_text: str) -> list[dict]:
    """Every collective node of an IR dump: ``{"kind", "group" (sorted rank tuple), "group_size",
    "layer" (int or None), "backward" (bool), "scope"}``."""
    lines = ir_text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _NODE.search(line)
        if not m:
            continue
        ranks = _RANKS.search(line)
        group = tuple(int(r) for r in ranks.group(1).replace(" ", "").split(",") if r) if ranks else ()
        scope = ""
        for nxt in lines[i + 1:i + 4]:
            s = _SCOPE.search(nxt)
            if s:
                scope = s.group(1)
                break
        layer = _LAYER.search(scope)
        out.append({"kind": m.group(1), "group": group, "group_size": len(group),
                    "layer": int(layer.group(1)) if layer else None,
                    "backward": scope.startswith("Gradients/") or "/Gradients/" in scope, "scope": scope})
    return out


def summarize(nodes: list[dict]) -> dict:
    """``{"total": {"AllReduce x2": n, ...}, "per_layer": {layer: {"AllReduce x2": n}}, "ops": [...]}``
    (keys ``KIND xGROUP_SIZE``; layers as strings for JSON; ``ops`` every node of :func:`collectives`
    with its group as a list)."""
    total = Counter(f"{n['kind']} x{n['group_size']}" for n in nodes)
    per_layer: dict = {}
    for n in nodes:
        if n["layer"] is not None:
            per_layer.setdefault(str(n["layer"]), Counter())[f"{n['kind']} x{n['group_size']}"] += 1
    return {"total": dict(sorted(total.items())),
            "per_layer": {k: dict(sorted(v.items())) for k, v in sorted(per_layer.items(), key=lambda kv: int(kv[0]))},
            "ops": [{**n, "group": list(n["group"])} for n in nodes]}


# MindSpore's messages for a layout it rejects -> the YAML key to change (first match wins)
_KEY_HINTS = (
    (re.compile(r"ran out of host memory"), "none: run fewer ranks at once (--sim_jobs) or on a larger host"),
    (re.compile(r"type must be same|Float16|BFloat16|dtype", re.I),
     "model.model_config.param_init_type / compute_dtype (or optimizer.type)"),
    (re.compile(r"pipeline|stage|micro", re.I), "parallel_config.pipeline_stage / micro_batch_num"),
    (re.compile(r"strategy|shard|dev_matrix|device matrix|divisible|can not be divided|split", re.I),
     "parallel_config.model_parallel / data_parallel"),
    (re.compile(r"optimizer|opt_shard", re.I), "parallel.enable_parallel_optimizer"),
    (re.compile(r"memory|out of memory|exceed", re.I), "context.max_device_memory / recompute_config"),
)


def key_for_error(message: str) -> str:
    """The YAML key a MindSpore layout error most likely concerns (a hint, named as such)."""
    for pattern, key in _KEY_HINTS:
        if pattern.search(message):
            return key
    return "parallel_config"


def first_lines(message: str, n: int = 3) -> str:
    """MindSpore's message without its C++ call stack and traceback sections."""
    head = re.split(r"\n-{4,}", message)[0]  # MindSpore's sections start with a line of dashes
    return " ".join(line.strip() for line in head.strip().splitlines()[:n] if line.strip())


__all__ = ["COLLECTIVE_KINDS", "collectives", "first_lines", "graph_size", "key_for_error", "parse_peak_memory", "summarize",
           "validate_ir"]
