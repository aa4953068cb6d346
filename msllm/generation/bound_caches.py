"""Key/value caches kept per shape, whose decode step holds them as graph Parameters.

Why: a compiled MindSpore graph pays, at every call, for each tensor passed in. The decode step
took a model's caches as one ``ms.mutable`` tuple of ``2 * num_layers`` Parameters, and those 60
inputs (SmolLM2) cost MindSpore 2.10's CPU runtime about 25 us each per call: flattening the
tuple (``AnfRuntimeAlgorithm::FlattenInputArg`` -> ``AnfAlgo::IsDynamicSequence``), then the
input actors' bookkeeping and ``ClearActorData`` (``perf`` call stacks of the batch-1 step). A
graph's own Parameters (the weights) cost nothing per call. So a cache set kept here gets a
decode cell that holds it as its Parameters (:class:`BoundStep` in
:mod:`msllm.generation.decode`); the step's inputs are then the four small tensors. Measured on
SmolLM2 at batch 1 (Intel Xeon, one process, alternated; BENCHMARKS.md "Caches held by the
decode graph"): the step of a 30-layer model with hidden size 64 3.5 -> 2.05 ms, the int8 step
about 1.5-2 ms less.

The cost: a compiled graph per cache set, not per shape, so sets are kept and reused (one per
(rows, slots) shape) instead of made per generation. A set is *leased* by one user at a time
(a generation call, the serving batch): a shape whose set is out, or that would take the kept
sets past the byte budget, gets a private cache and the tuple-input step, as before. The budget
(``MSLLM_BOUND_CACHE_MB``, default 512; 0 turns this off) bounds the memory kept after use.

A reused set holds its previous user's keys and values. Nothing reads them: a prefill writes
every slot of the prompt block, a decode step writes its slot before attending, and every other
slot is hidden from its row (padding has key position -1, a later slot a position after the
query's): msllm's decode kernels skip it, the composed attention gives it weight exactly 0.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from msllm.errors import MsllmError

ENV = "MSLLM_BOUND_CACHE_MB"
DEFAULT_MB = 512


def budget_bytes() -> int:
    """The byte budget of kept cache sets: ``MSLLM_BOUND_CACHE_MB`` (MiB, an integer >= 0) or
    :data:`DEFAULT_MB`. Raises MsllmError naming the variable for any other value."""
    raw = os.environ.get(ENV)
    if raw is None or raw == "":
        return DEFAULT_MB << 20
    try:
        mb = int(raw)
    except ValueError:
        mb = -1
    if mb < 0:
        raise MsllmError(f"{ENV}={raw!r}: expected a whole number of MiB >= 0 (0 keeps no cache sets)")
    return mb << 20


@dataclass
class _Entry:
    caches: tuple
    nbytes: int
    leased: bool = False
    cell: Optional[object] = field(default=None, repr=False)


class BoundCaches:
    """Cache sets per (rows, slots) shape and their decode cells (module doc).

    Args:
        make_cache: ``(rows, slots, name) -> caches`` (a tuple of Parameters, names starting
            with ``name``: each set its own names).
        make_cell: ``caches -> cell`` whose call ``(ids, positions, key_positions, index)`` is the
            decode step over those caches.
        nbytes: ``(rows, slots) -> bytes`` of one set.
        budget: bytes the kept sets may take (:func:`budget_bytes`).
    """

    def __init__(self, make_cache: Callable, make_cell: Callable, nbytes: Callable[[int, int], int], budget: int):
        self.make_cache, self.make_cell, self.nbytes, self.budget = make_cache, make_cell, nbytes, budget
        self.by_shape: dict = {}      # (rows, slots) -> _Entry
        self.by_id: dict = {}         # id(caches) -> _Entry (the entry keeps its tuple, so the id stays its own)
        self.lock = threading.Lock()  # a generation on one thread, the serving batch on another

    @property
    def kept_bytes(self) -> int:
        return sum(e.nbytes for e in self.by_shape.values())

    def lease(self, rows: int, slots: int) -> Optional[tuple]:
        """The kept set of this shape, now leased to the caller, made if the budget allows; None
        when it is leased already or does not fit (the caller makes a private cache)."""
        with self.lock:
            e = self.by_shape.get((rows, slots))
            if e is None:
                size = self.nbytes(rows, slots)
                if self.kept_bytes + size > self.budget:
                    return None
                e = _Entry(self.make_cache(rows, slots, f"kv_cache_b{rows}_s{slots}_"), size)
                self.by_shape[(rows, slots)] = e
                self.by_id[id(e.caches)] = e
            if e.leased:
                return None
            e.leased = True
            return e.caches

    def release(self, caches) -> None:
        """Give a leased set back (anything else: nothing happens)."""
        with self.lock:
            e = self.by_id.get(id(caches))
            if e is not None and e.caches is caches:
                e.leased = False

    def cell_for(self, caches):
        """The decode cell holding ``caches`` if it is a kept set (made on first use; it compiles
        on its first call), else None. Called by the set's leaseholder only."""
        e = self.by_id.get(id(caches))
        if e is None or e.caches is not caches:
            return None
        if e.cell is None:
            e.cell = self.make_cell(caches)
        return e.cell


__all__ = ["BoundCaches", "budget_bytes", "ENV", "DEFAULT_MB"]
