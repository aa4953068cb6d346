"""Convert Stanford Alpaca JSON to the conversation JSON read by ``llama_preprocess.py``.

Usage (flags of MindFormers ``alpaca_converter.py``)::

    python data_preprocess/alpaca_converter.py --data_path alpaca_data.json \
        --output_path alpaca-data-conversation.json

Logic: :func:`msllm.data.conversation.convert_alpaca_file`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.data.conversation import convert_alpaca_file  # noqa: E402
from msllm.errors import cli_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_path", required=True, help="Alpaca JSON file (list of instruction/input/output)")
    parser.add_argument("--output_path", required=True, help="conversation JSON to write (atomically)")
    return parser.parse_args(argv)


@cli_main
def main(argv=None) -> None:
    """Run the conversion and print a summary."""
    args = parse_args(argv)
    s = convert_alpaca_file(args.data_path, args.output_path)
    print(
        f"read {s['records_read']} records from {args.data_path} "
        f"({s['with_input']} with input, {s['without_input']} without); "
        f"wrote {s['records_written']} conversations to {s['output_path']}"
    )


if __name__ == "__main__":
    main()
