"""Calling an already compiled generation graph without MindSpore's per-call Python work.

A GRAPH_MODE ``Cell`` call runs, before the graph, MindSpore's Python ``compile`` even when the
graph exists (``mindspore/nn/cell.py`` ``Cell.compile_and_run`` -> ``graph/api.py``
``_CellGraphExecutor.compile``, MindSpore 2.10): it builds the argument key and, to name the
phase, sets ``compile_phase`` on every sub-cell through ``Cell.__setattr__`` (about 400 cells for
a 30-layer model). SmolLM2's batch-1 float32 decode step spent 4.8 ms per token in Python, 1.5 ms
with the replay: the step 42.8 -> 37.7 ms (0.88x, 4 alternating rounds on the Intel Xeon,
``benchmarks/decode_call_overhead.py``, ``benchmarks/results/decode_call_overhead_smollm2_intel_xeon.json``).

:func:`replay_cell` gives a cell class a ``compile_and_run`` that, after the first call with a
given argument signature (each tensor's shape and dtype, each ``ms.mutable`` tuple's length and
its tensors' shapes and dtypes) went through MindSpore's own path (which compiled it and named
its phase), runs that phase's graph directly: MindSpore's ``get_args_for_run`` (the argument
conversion its own call does next), its jit config and ``_exec_pip``, as ``compile_and_run`` does after its
``compile``. The signature is the one MindSpore's key is made of for these cells (tensors and
mutable tuples of tensors, no Python scalars, no top-level Parameter), so the graph run is the
one MindSpore's own call would pick. A call with any other kind of argument, or a MindSpore
without these attributes, takes MindSpore's path every time.

Its ``__call__`` goes to that graph too for a signature already recorded, in graph mode, skipping
``Cell.__call__``'s checks of the arguments against ``construct`` (``_check_construct_args``, which
builds ``inspect.signature`` of it on every call): they ran at the signature's first call, and
depend only on what the signature holds (the count and kind of the arguments).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def _signature(args):
    """(shape, dtype) of each tensor argument, and per tuple argument the same of each element;
    None when an argument is neither (the call then takes MindSpore's path)."""
    key = []
    for a in args:
        if isinstance(a, (tuple, list)):
            items = []
            for e in a:
                shape = getattr(e, "shape", None)
                if shape is None:
                    return None
                items.append((tuple(shape), str(e.dtype)))
            key.append(tuple(items))
        else:
            shape = getattr(a, "shape", None)
            if shape is None or not hasattr(a, "dtype"):
                return None
            key.append((tuple(shape), str(a.dtype)))
    return tuple(key)


def _hit(cell, args):
    """The (phase, mutable flags) recorded for the signature of ``args`` on ``cell``, or None."""
    phases = cell.__dict__.get("_replay_phases")
    if not phases:
        return None
    key = _signature(args)
    return phases.get(key) if key is not None else None


def _run_phase(cell, hit, args):
    """Runs the compiled graph ``hit`` = (phase, mutable flags) of ``cell`` on ``args`` as
    ``compile_and_run`` does after its ``compile`` (module doc)."""
    from mindspore.graph.api import _cell_graph_executor
    from mindspore.graph.jit_config import _DEFAULT_JIT_CONFIG

    phase, flags = hit
    executor = _cell_graph_executor._graph_executor
    run_args = executor.get_args_for_run(cell, args, {}, flags, [], False, False)
    executor.set_jit_config(getattr(cell, "jit_config_dict", None) or _DEFAULT_JIT_CONFIG)
    return _cell_graph_executor._exec_pip(cell, *run_args, phase=phase)


def replay_cell(base):
    """A subclass of the ``nn.Cell`` subclass ``base`` whose calls after the first of each
    argument signature skip MindSpore's per-call ``compile`` (module doc). Same results: the
    same compiled graph runs on the same converted arguments."""

    class Replayed(base):
        def __call__(self, *args, **kwargs):
            # A replayed signature also skips Cell.__call__'s argument checks (inspect.signature of
            # construct, ~0.1 ms per call): they ran at the signature's first call, on the same
            # shapes and dtypes. Graph mode only: in PyNative MindSpore's own call runs construct.
            from mindspore import context

            hit = None
            if not kwargs and context._get_mode() == context.GRAPH_MODE and os.getenv("MS_JIT") != "0":
                hit = _hit(self, args)
            return _run_phase(self, hit, args) if hit is not None else super().__call__(*args, **kwargs)

        def compile_and_run(self, *args, **kwargs):
            hit = None if kwargs else _hit(self, args)
            if hit is not None:
                return _run_phase(self, hit, args)
            out = super().compile_and_run(*args, **kwargs)
            phases = self.__dict__.setdefault("_replay_phases", {})
            key = None if kwargs or phases is None else _signature(args)
            if key is not None:                # record the phase MindSpore's call compiled and named
                try:
                    phases[key] = (self.current_phase, list(self._has_mutable_args_list or []))
                except AttributeError:         # another MindSpore: its own path from now on
                    log.info("replay_cell: this MindSpore has no current_phase / mutable flags")
                    self.__dict__["_replay_phases"] = None
            return out

    Replayed.__name__ = Replayed.__qualname__ = base.__name__
    Replayed.__doc__ = base.__doc__
    return Replayed
