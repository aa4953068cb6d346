"""Tokenize conversation JSON (qa) or plain text (wiki) into a LLaMA training MindRecord.

Usage (flags of MindFormers ``llama_preprocess.py``)::

    python data_preprocess/llama_preprocess.py --input_glob 'alpaca-data-conversation.json' \
        --dataset_type qa --model_file tokenizer.model --seq_length 1024 \
        --repeat 1 --shuffle 1 --output_file alpaca.mindrecord [--num_workers 2]

Writes ``OUT.mindrecord``, ``OUT.mindrecord.db`` and the metadata sidecar ``OUT.mindrecord.json``.
Logic: :func:`msllm.data.preprocess.preprocess_to_mindrecord`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.data.preprocess import preprocess_to_mindrecord  # noqa: E402
from msllm.errors import cli_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input_glob", required=True, help="glob of input files (quote it)")
    p.add_argument("--dataset_type", required=True, choices=["qa", "wiki"],
                   help="qa: conversation JSON; wiki: text lines / .json(l) with 'text'")
    p.add_argument("--model_file", required=True, help="SentencePiece tokenizer.model")
    p.add_argument("--seq_length", type=int, default=1024, help="model sequence length; rows hold seq_length+1")
    p.add_argument("--repeat", type=int, default=1, help="repeat the sample list N times")
    p.add_argument("--shuffle", type=int, choices=[0, 1], default=1, help="1: shuffle samples (after repeat)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (numpy default_rng)")
    p.add_argument("--num_workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--pad_token_id", type=int, default=0, help="padding id for input_ids (LLaMA has no pad piece)")
    p.add_argument("--output_file", required=True, help="output .mindrecord")
    p.add_argument("--no_progress", action="store_true", help="hide the progress bars")
    return p.parse_args(argv)


@cli_main
def main(argv=None) -> None:
    """Run the preprocessing and print the summary."""
    a = parse_args(argv)
    summary = preprocess_to_mindrecord(
        input_glob=a.input_glob, dataset_type=a.dataset_type, model_file=a.model_file,
        seq_length=a.seq_length, output_file=a.output_file, repeat=a.repeat,
        shuffle=bool(a.shuffle), seed=a.seed, num_workers=a.num_workers,
        pad_token_id=a.pad_token_id, progress=not a.no_progress,
    )
    print(summary.format())


if __name__ == "__main__":
    main()
