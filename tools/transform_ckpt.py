"""Reshard a checkpoint between parallel layouts (MindFormers ``transform_ckpt.py`` flags).

Usage::

    python tools/transform_ckpt.py --src_ckpt_strategy SRC --dst_ckpt_strategy DST \
        --src_ckpt_dir DIR --dst_ckpt_dir DIR [--prefix checkpoint_]

* ``--src_ckpt_dir``: ``DIR/rank_{i}/*.ckpt`` (a full checkpoint may be one file or
  ``DIR/rank_0/x.ckpt``); per rank the newest msllm checkpoint is used.
* ``--src_ckpt_strategy`` / ``--dst_ckpt_strategy``: a strategy file or a directory of per-rank
  strategy files (``ckpt_strategy_rank_{i}.ckpt`` in MindSpore's protobuf encoding, as
  ``run_msllm.py --only_save_strategy True`` and MindFormers/MindSpore training write them, or
  ``.json``; pipeline stages are merged as needed). Strategies and checkpoints in MindFormers'
  LLaMA names work with msllm-named ones (the names are matched). Empty or absent: the checkpoint
  is full (source) / merge to a full checkpoint (destination).
* Output: ``--dst_ckpt_dir/rank_{i}/{prefix}{i}.ckpt``, published atomically; an existing
  non-empty destination is refused unless ``--overwrite``.

Logic: :func:`msllm.parallel.reshard.transform_checkpoints` (wraps
``mindspore.transform_checkpoints``). Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.errors import MsllmError, cli_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--src_ckpt_strategy", default="", help="source strategy file/dir; empty = full checkpoint")
    p.add_argument("--dst_ckpt_strategy", default="", help="destination strategy file/dir; empty = merge to full")
    p.add_argument("--src_ckpt_dir", required=True, help="source checkpoint directory (rank_*/ inside) or file")
    p.add_argument("--dst_ckpt_dir", required=True, help="destination directory (rank_*/ are created)")
    p.add_argument("--prefix", default="checkpoint_", help="output file prefix: rank_{i}/{prefix}{i}.ckpt")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty dst_ckpt_dir")
    return p.parse_args(argv)


@cli_main
def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    from msllm.parallel.reshard import transform_checkpoints

    if not os.path.exists(args.src_ckpt_dir):
        raise MsllmError(f"--src_ckpt_dir {args.src_ckpt_dir!r} does not exist")
    t0 = time.perf_counter()
    out = transform_checkpoints(args.src_ckpt_dir, args.dst_ckpt_dir, args.src_ckpt_strategy or None,
                                args.dst_ckpt_strategy or None, args.prefix, overwrite=args.overwrite)
    print(f"wrote {len(out)} rank checkpoint(s) to {os.path.abspath(args.dst_ckpt_dir)} "
          f"in {time.perf_counter() - t0:.1f}s")
    for rank, path in out.items():
        print(f"  rank {rank}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
