"""The split of decoder layers over pipeline stages with MindFormers' ``offset`` and
``pp_interleave_num`` keys: a layout rule, used by the layout checks, the device checks, the
dry-run and the pipeline train step (:mod:`msllm.training.pipeline`).

Stage split (MindFormers ``mindformers/models/utils.py`` ``LayerSetting``): with ``p`` stages and
``v = pp_interleave_num`` chunks per stage, each (chunk, stage) holds ``num_layers // (p * v)``
layers plus its ``offset`` (an int, a list of ``p`` ints, or ``v`` lists of ``p``); layers fill
chunk 0 of stages 0..p-1, then chunk 1, ... The offsets must sum to ``num_layers % (p * v)`` so
that every layer has a stage; msllm refuses any other split before MindSpore sees it.
"""

from __future__ import annotations

from typing import Sequence, Union

from msllm.errors import MsllmError

Offset = Union[int, Sequence[int], Sequence[Sequence[int]]]


def _offset_grid(offset: Offset, pp: int, v: int) -> list[list[int]]:
    """``offset`` as ``v`` rows of ``pp`` ints (MindFormers broadcasts an int or one row)."""
    if isinstance(offset, bool):
        raise MsllmError(f"model.model_config.offset={offset!r}: expected an int or a list of ints")
    if isinstance(offset, int):
        return [[offset] * pp for _ in range(v)]
    rows = list(offset)
    if all(isinstance(o, int) and not isinstance(o, bool) for o in rows):
        rows = [rows] * v
    if len(rows) != v or any(not isinstance(r, (list, tuple)) or len(r) != pp for r in rows):
        raise MsllmError(f"model.model_config.offset={offset!r}: expected an int, a list of pipeline_stage={pp} "
                         f"ints, or pp_interleave_num={v} such lists")
    return [[int(x) for x in r] for r in rows]


def stage_assignment(num_layers: int, pipeline_stage: int, offset: Offset = 0,
                     pp_interleave_num: int = 1) -> list[tuple[int, int]]:
    """``(stage, chunk)`` of each decoder layer, in layer order (MindFormers' ``LayerSetting`` rule,
    module docstring).

    Raises:
        MsllmError: a split that leaves a layer without a stage or a (chunk, stage) without a layer:
            the offsets do not sum to ``num_layers % (pipeline_stage * pp_interleave_num)`` (with
            offset 0: the layers are not divisible by the stages), a negative count, or a
            malformed offset; each message names the key to change.
    """
    pp, v = int(pipeline_stage), int(pp_interleave_num)
    if v < 1:
        raise MsllmError(f"model.model_config.pp_interleave_num={v}: expected >= 1")
    grid = _offset_grid(offset, pp, v)
    chunks = pp * v
    avg, rest = divmod(num_layers, chunks)
    total = sum(map(sum, grid))
    if total != rest:
        if not any(map(any, grid)):
            raise MsllmError(f"model.model_config.num_layers={num_layers} is not divisible by pipeline_stage={pp}"
                             + (f" x pp_interleave_num={v}" if v > 1 else "")
                             + f": set model.model_config.offset (a list of {pp} per-stage extra layers summing to "
                             f"{rest}, MindFormers' key) or change parallel_config.pipeline_stage")
        raise MsllmError(f"model.model_config.offset={offset!r} sums to {total}, but num_layers={num_layers} over "
                         f"{pp} stage(s) x {v} chunk(s) leaves {rest} layer(s) to place: the offsets must sum to "
                         f"{rest} (MindFormers' LayerSetting rule)")
    counts = [[avg + grid[c][s] for s in range(pp)] for c in range(v)]
    if any(n < 1 for row in counts for n in row):
        raise MsllmError(f"model.model_config.offset={offset!r} leaves a pipeline stage without a layer "
                         f"(layers per chunk and stage: {counts}); every stage needs at least one")
    out = []
    for c in range(v):
        for s in range(pp):
            out.extend([(s, c)] * counts[c][s])
    return out


def stage_layers_of(model_config, pipeline_stage: int) -> list[int] | None:
    """Layers per stage for msllm's layout tables (:func:`msllm.parallel.layout_checks.stage_layer_counts`)
    when the split is contiguous (``pp_interleave_num`` 1), from the model config's ``offset``;
    ``None`` without pipelining. Raises MsllmError as :func:`stage_assignment`."""
    if pipeline_stage <= 1:
        return None
    assign = stage_assignment(model_config.num_layers, pipeline_stage, getattr(model_config, "offset", 0),
                              getattr(model_config, "pp_interleave_num", 1))
    return [sum(1 for s, _c in assign if s == st) for st in range(pipeline_stage)]


__all__ = ["Offset", "stage_assignment", "stage_layers_of"]
