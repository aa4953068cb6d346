"""What one dry-run rank holds in device memory at its peak, by kind, from MindSpore's memory
tracker (issue #30; docs/dryrun.md).

Run the dry-run with ``MS_ALLOC_CONF=memory_tracker:True,memory_tracker_path:DIR`` (MindSpore writes
``DIR/rank_R/memory_block.csv``: each block's type, owner node, size and lifetime), then:

    python benchmarks/dryrun_memory_breakdown.py DIR/rank_R/memory_block.csv

Prints the peak (the largest ``actual_used_memory``) and the blocks alive at that moment grouped as
parameters, gradient accumulators (``accu_grads.*``), AdamW moments (``adam_m.*`` / ``adam_v.*``),
constants (``ConstantValue``: graph constants and inputs) and kernel outputs by operator, in MiB.
"""

from __future__ import annotations

import collections
import csv
import re
import sys


def breakdown(path: str) -> tuple[float, str, list[tuple[str, float]]]:
    """(peak MiB, the node allocating at the peak, [(group, MiB)] largest first)."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    peak = max(rows, key=lambda r: int(r["actual_used_memory"]))
    t = int(peak["start_time_stamp"])
    groups: collections.Counter = collections.Counter()
    for r in rows:
        if int(r["start_time_stamp"]) <= t < int(r["end_time_stamp"]):
            groups[_group(r)] += int(r["size"])
    return (int(peak["actual_used_memory"]) / 2**20, peak["node_name"],
            [(g, b / 2**20) for g, b in groups.most_common()])


def _group(row) -> str:
    name = row["node_name"]
    if row["type"] == "Weight":
        for prefix, label in (("accu_grads.", "gradient accumulators"), ("adam_m.", "AdamW moments"),
                              ("adam_v.", "AdamW moments")):
            if name.startswith(prefix):
                return label
        return "parameters"
    if row["type"] == "ConstantValue":
        return "constants (graph values and inputs)"
    return f"kernel outputs: {re.sub(r'-op[0-9]+$', '', name.rsplit('/', 1)[-1])}"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    mib, node, groups = breakdown(sys.argv[1])
    print(f"peak {mib:.1f} MiB (allocated by {node})")
    for g, m in groups:
        if m >= 0.05:
            print(f"  {m:9.1f} MiB  {g}")
