"""Data-parallel evaluation: split work items over ranks, gather every request's numbers exactly.

Split: every rank computes the same plan (:meth:`msllm.eval.scoring.Scorer.plan` depends only on
the requests), then items go to ranks by a deterministic greedy balance of their token counts.
An item (a batch or a shared-prefix group) is scored the same way whichever rank runs it, so each
request's numbers do not depend on the number of ranks.

Merge: each rank encodes its results as float64 records ``[index, length, values...]``; their
bytes travel through :func:`msllm.cluster.gather.all_gather_bytes` (exact for any size), so the
gathered values are bit-identical to the local ones. Every rank then aggregates the same full set of results in
request order: the totals of a 2-rank run equal a 1-rank run's exactly.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised MindSpore process group; (0, 1) when alone."""
    try:
        from mindspore.communication import get_group_size, get_rank

        return int(get_rank()), int(get_group_size())
    except (RuntimeError, ValueError):
        return 0, 1


def assign(costs: Sequence[int], world_size: int) -> list[int]:
    """Owner rank of each item: largest first to the least loaded rank (ties: lower rank, then
    item order). Deterministic in ``costs`` alone."""
    load = [0] * world_size
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def encode(records: dict) -> np.ndarray:
    """``{index: float values}`` -> flat float64 ``[index, n, v_1..v_n, ...]`` (index order)."""
    parts = []
    for k in sorted(records):
        v = np.asarray(records[k], np.float64).reshape(-1)
        parts.append(np.concatenate([[float(k), float(v.size)], v]))
    return np.concatenate(parts) if parts else np.zeros(0, np.float64)


def decode(flat: np.ndarray) -> dict:
    out, i = {}, 0
    while i < flat.size:
        k, n = int(flat[i]), int(flat[i + 1])
        out[k] = flat[i + 2:i + 2 + n].copy()
        i += 2 + n
    return out


def all_gather_records(records: dict, world_size: int) -> dict:
    """Every rank's ``{index: values}`` merged, identical on all ranks (exact float64: the bytes
    travel through :func:`msllm.cluster.gather.all_gather_bytes`)."""
    if world_size == 1:
        return {k: np.asarray(v, np.float64).reshape(-1) for k, v in records.items()}
    from msllm.cluster.gather import all_gather_bytes

    merged: dict = {}
    for blob in all_gather_bytes(encode(records).tobytes(), world_size):
        merged.update(decode(np.frombuffer(blob, np.float64)))
    return merged
