"""The graph shapes the server compiles at start beyond its first requests' (``Engine.warmup``):
each new shape costs one compile (about 4.5 s for SmolLM2-135M on an idle 2-core CPU, up to ~10 s
on a busy one), which a request meeting it first would wait for, and every row decoding with it.

* the decode step at ``max_batch`` rows over each cache width from 1024 slots to ``slots`` (the
  batch widens to the next power of two when a long prompt joins: :meth:`ContinuousBatch.buffer_for`);
* with the prefix cache: the suffix pieces (1 row, E tokens, 512 slots), E = 32, 64, ..., 512
  (at most the chunk size) (:mod:`msllm.serving.staged_prefill`);
* with chunked prefill: the chunks (1 row, chunk tokens, S slots) for every own-cache width S
  from the first above the chunk size to ``slots``.

Each shape runs once on a scratch cache with padding ids (its output is discarded).
"""

from __future__ import annotations

import numpy as np

from msllm.generation.passes import pow2_at_least

FIRST_SLOTS = 512     # the smallest cache (msllm.serving.batch.MIN_BUFFER)


def warm_shapes(max_batch: int, chunk: int, prefix: bool, slots: int) -> list:
    """(kind, rows, tokens, cache slots) to compile, in order (module docstring). ``slots`` is
    the widest cache to prepare (a power of two >= 512; smaller: no decode or chunk widths)."""
    widths = []
    s = 2 * FIRST_SLOTS
    while s <= slots:
        widths.append(s)
        s *= 2
    out = [("decode", max_batch, 1, s) for s in widths]
    if prefix:
        e = 32
        while e <= min(chunk or FIRST_SLOTS, FIRST_SLOTS):
            out.append(("extend", 1, e, FIRST_SLOTS))
            e *= 2
    if chunk:
        for s in [FIRST_SLOTS] + widths:
            if s > chunk and ("extend", 1, chunk, s) not in out:
                out.append(("extend", 1, chunk, s))
    return out


def run_shapes(gen, shapes: list, pad_id: int) -> None:
    """Call each (kind, rows, tokens, slots) of ``shapes`` once through ``gen.run`` (a
    :class:`~msllm.generation.decode.Generator`) on a cache of that size (a decode shape on the
    generator's kept set of that shape if it has room, :meth:`Generator.lease_cache`: the batch
    will decode on it, through the graph compiled here); rows see only their first slot (key
    position 0), the tokens are ``pad_id``."""
    for kind, rows, tokens, slots in shapes:
        caches = gen.lease_cache(rows, slots) if kind == "decode" else gen.empty_cache(rows, slots)
        kpos = np.full((rows, slots), -1, np.int32)
        kpos[:, 0] = 0
        where = np.arange(tokens)
        try:
            gen.run(kind, np.full((rows, tokens), pad_id, np.int32), np.zeros((rows, tokens), np.int32), kpos,
                    where if kind != "decode" else np.zeros((rows, 1), np.int64), caches)
        finally:
            gen.release_cache(caches)
        del caches


def default_slots(context: int) -> int:
    """The widest cache worth warming for a model of ``context`` positions: a 2,000-token prompt
    with its answer (4096 slots), or the context's power of two if smaller."""
    return min(4096, pow2_at_least(context, FIRST_SLOTS))


__all__ = ["warm_shapes", "run_shapes", "default_slots"]
