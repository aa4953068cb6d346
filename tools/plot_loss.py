#!/usr/bin/env python
"""Overlay the loss curves of training runs in one PNG.

    python tools/plot_loss.py RUN_DIR [RUN_DIR ...] [--out loss.png] [--rank 0] [--smooth 10]

Each RUN_DIR is a training ``output_dir`` (or a ``train_summary_rank_{r}.json`` file): its
per-step train losses and, when the run evaluated (``do_eval``), its evaluation losses are drawn;
``--smooth`` is the moving-average window. Bad input: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.errors import MsllmError, cli_main  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    from msllm.training.curves import plot_runs, read_run

    parser = argparse.ArgumentParser(prog="plot_loss.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="training output directories or summary JSON files")
    parser.add_argument("--out", default="loss_curves.png", help="PNG to write (default loss_curves.png)")
    parser.add_argument("--rank", type=int, default=None, help="which rank's summary (default: lowest found)")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window in steps (default 10)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        raise MsllmError("--smooth must be >= 1")
    runs = [read_run(r, args.rank) for r in args.runs]
    labels = [r["label"] for r in runs]
    if len(set(labels)) < len(labels):  # same directory names: label by the full path instead
        for r, path in zip(runs, args.runs):
            r["label"] = os.path.abspath(path)
    out = plot_runs(runs, args.out, args.smooth)
    print(f"wrote {out} ({len(runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
