"""Merge per-server HCCL rank tables into the table of the whole cluster.

Usage (as MindFormers ``mindformers/tools/merge_hccl.py``)::

    python tools/merge_hccl.py hccl_8p_01234567_90.90.3.1.json hccl_8p_01234567_90.90.3.2.json \
        [--output PATH]

Servers keep the order given; rank ids are renumbered 0..N-1 in that order. Default output:
``./hccl_{S}s_{N}p.json`` (S servers, N devices), e.g. ``hccl_2s_16p.json``.

Logic: :func:`msllm.cluster.rank_table.merge_rank_table_files`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.cluster.rank_table import merge_rank_table_files  # noqa: E402
from msllm.errors import cli_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file_list", nargs="+", help="per-server rank table files, in rank order")
    parser.add_argument("--output", default=None,
                        help="file (or existing directory) to write; default ./hccl_{S}s_{N}p.json")
    return parser.parse_args(argv)


@cli_main
def main(argv=None) -> None:
    """Merge and write."""
    args = parse_args(argv)
    merge_rank_table_files(args.file_list, args.output)


if __name__ == "__main__":
    main()
