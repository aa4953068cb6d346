"""Compare MindSpore's strategy files (written by the dry-run, ``output_dir/strategy``) with msllm's
offline ones (``--only_save_strategy``), rank by rank: the same parameters with the same
dev_matrix, tensor_map, field and optimizer-shard entries (issue #30; docs/dryrun.md).

Usage: python benchmarks/compare_strategy_files.py MINDSPORE_DIR MSLLM_DIR
Prints one line per rank file of MINDSPORE_DIR; exits 1 if any differs.
"""

from __future__ import annotations

import os
import sys

KEYS = ("dev_matrix", "tensor_map", "field", "opt_weight_shard_step", "opt_weight_shard_size")


def compare(ms_dir: str, ours_dir: str) -> int:
    from msllm.parallel.strategy_files import load_strategy_map

    bad = 0
    for name in sorted(os.listdir(ms_dir), key=lambda n: int(n.rsplit("_", 1)[1].split(".")[0])):
        a = load_strategy_map(os.path.join(ms_dir, name))["parallel_layout_item"]
        b = load_strategy_map(os.path.join(ours_dir, name))["parallel_layout_item"]
        diff = [n for n in a if n not in b or {k: a[n][k] for k in KEYS} != {k: b[n][k] for k in KEYS}]
        extra = sorted(set(b) - set(a))
        bad += bool(diff or extra)
        print(f"{name}: MindSpore {len(a)} parameters, msllm {len(b)}; differing {len(diff)}, only in msllm "
              f"{len(extra)}" + (f" e.g. {(diff + extra)[:3]}" if diff or extra else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(compare(sys.argv[1], sys.argv[2]))
