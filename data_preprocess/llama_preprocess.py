"""Tokenize conversation JSON (qa) or text (wiki) into a LLaMA training MindRecord.

Usage (the flags of MindFormers ``mindformers/tools/dataset_preprocess/llama/llama_preprocess.py``,
plus msllm's own)::

    python data_preprocess/llama_preprocess.py --dataset_type qa \
        --input_glob 'alpaca-data-conversation.json' --model_file tokenizer.model \
        --seq_length 2048 --output_file alpaca.mindrecord [--num_workers 2] [--template vicuna_v1.1]

``--dataset_type qa`` renders each conversation with ``--template`` (default ``vicuna_v1.1``:
MindFormers' samples, identical ``input_ids``); ``wiki`` packs text (WikiText is cleaned as
MindFormers' ``clean_wikitext`` does). ``--output_file`` may omit ``.mindrecord`` (MindFormers'
default ``./dataset/wiki2048/wiki2048``); ``--file_partition N`` writes the shards
``OUTPUT0`` ... ``OUTPUT{N-1}`` as ``FileWriter(shard_num=N)`` names them. Each data file gets its
``.db`` and a metadata sidecar ``.json`` (with the template name).
``--pack`` (qa) packs whole conversations into the rows with an ``actual_seq_len`` column
(:mod:`msllm.data.packing`, docs/packing.md).
``--dataset_type dpo`` reads pairwise preference records (MindSpeed-LLM's and TRL's formats) into
a MindRecord of ``chosen_input_ids`` / ``chosen_labels`` / ``rejected_input_ids`` /
``rejected_labels`` (:mod:`msllm.data.preference`, docs/dpo.md).
Logic: :func:`msllm.data.preprocess.preprocess_to_mindrecord`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.data.preprocess import DATASET_TYPES, preprocess_to_mindrecord  # noqa: E402
from msllm.data.templates import ALL_TEMPLATE_NAMES, DEFAULT_TEMPLATE  # noqa: E402
from msllm.data.tokenizer import load_tokenizer  # noqa: E402
from msllm.errors import MsllmError, cli_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input_glob", required=True, help="glob of input files (quote it)")
    p.add_argument("--dataset_type", default="wiki", choices=list(DATASET_TYPES) + ["dpo"],
                   help="qa: conversation JSON; wiki: text lines, WikiText, or .json(l) with 'text' "
                        "(default wiki, as MindFormers); dpo: pairwise preference records "
                        "(prompt/chosen/rejected, docs/dpo.md)")
    p.add_argument("--model_file", required=True,
                   help="the tokenizer: a SentencePiece tokenizer.model, a Hugging Face tokenizer.json, or an HF "
                        "model directory (its tokenizer.json, tokenizer_config.json and chat template)")
    p.add_argument("--tokenizer", default="llama", choices=["llama"],
                   help="MindFormers' flag (only llama); the tokenizer's kind is read from --model_file")
    p.add_argument("--seq_length", type=int, default=2048,
                   help="model sequence length; rows hold seq_length+1 (default 2048, as MindFormers)")
    p.add_argument("--template", default=None, choices=list(ALL_TEMPLATE_NAMES),
                   help="qa prompt template (default: the tokenizer's own chat template when it has one, else "
                        f"{DEFAULT_TEMPLATE}: MindFormers' samples); chat_template: the model's Jinja template; "
                        "chatml: ChatML; alpaca: <s>human gpt</s> per pair (msllm's earlier layout); none: the "
                        "same layout, turns as given")
    p.add_argument("--repeat", type=int, default=1, help="repeat the sample list N times")
    p.add_argument("--shuffle", type=int, choices=[0, 1], default=1,
                   help="1: shuffle samples (after repeat); 0: input order (MindFormers' order)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (numpy default_rng)")
    p.add_argument("--samples_num", type=int, default=None,
                   help="keep only the first N samples built (MindFormers reads it for its parquet "
                        "'wikipedia' type only; msllm applies it to qa and wiki)")
    p.add_argument("--file_partition", type=int, default=1,
                   help="number of MindRecord shard files (FileWriter shard_num): OUTPUT0 ... OUTPUT{N-1}")
    p.add_argument("--num_workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--pad_token_id", type=int, default=0, help="padding id for input_ids (LLaMA has no pad piece)")
    p.add_argument("--output_file", required=True, help="output MindRecord name (.mindrecord suffix optional)")
    p.add_argument("--pack", action="store_true",
                   help="qa: pack whole conversations greedily into the rows and write MindFormers' "
                        "actual_seq_len column (MindSpeed-LLM's flag; MindFormers: PackingHandler, "
                        "pack_strategy 'pack'); training keeps every conversation apart (docs/packing.md)")
    p.add_argument("--no_progress", action="store_true", help="hide the progress bars")
    return p.parse_args(argv)


@cli_main
def main(argv=None) -> None:
    """Run the preprocessing and print the summary."""
    a = parse_args(argv)
    if a.dataset_type == "dpo":
        from msllm.data.preference import preprocess_preference

        unused = [f for f, v in (("--repeat", a.repeat != 1), ("--file_partition", a.file_partition != 1),
                                 ("--num_workers", a.num_workers != 1)) if v]
        if a.pack:
            unused.append("--pack")
        if unused:
            raise MsllmError(f"{', '.join(unused)}: not implemented for --dataset_type dpo (expected the defaults)")
        summary = preprocess_preference(a.input_glob, a.model_file, a.seq_length, a.output_file, a.template,
                                        bool(a.shuffle), a.seed, a.pad_token_id, a.samples_num)
        for key, value in summary.items():
            print(f"{key:<16}: {value}")
        return
    if a.template is not None and a.dataset_type != "qa":
        raise MsllmError(f"--template {a.template} applies to --dataset_type qa only (got {a.dataset_type})")
    template = None
    if a.dataset_type == "qa":
        template = a.template or ("chat_template" if load_tokenizer(a.model_file).chat_template else DEFAULT_TEMPLATE)
    summary = preprocess_to_mindrecord(
        input_glob=a.input_glob, dataset_type=a.dataset_type, model_file=a.model_file,
        seq_length=a.seq_length, output_file=a.output_file, repeat=a.repeat,
        shuffle=bool(a.shuffle), seed=a.seed, num_workers=a.num_workers,
        pad_token_id=a.pad_token_id, progress=not a.no_progress, template=template,
        file_partition=a.file_partition, samples_num=a.samples_num, pack=a.pack,
    )
    print(summary.format())


if __name__ == "__main__":
    main()
