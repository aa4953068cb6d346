"""Tokenize conversation JSON (``qa``) or text (``wiki``) into a training MindRecord.

The command-line front is ``data_preprocess/llama_preprocess.py`` (flags of MindFormers
``llama_preprocess.py``); this module holds the logic, :mod:`msllm.data.mindrecord` the I/O,
:mod:`msllm.data.templates` the prompt templates, :mod:`msllm.data.wiki` the ``wiki`` inputs.

Sample format (what the trainer reads; each row has ``seq_length + 1`` int32 values):
the trainer uses ``tokens = input_ids[:-1]`` and ``targets = labels[1:]`` and ignores targets
equal to :data:`IGNORE_INDEX`. ``input_ids`` are padded with ``pad_token_id`` (default 0),
``labels`` with :data:`IGNORE_INDEX` (as MindFormers pads: ``tokenizer._pad`` with ``<unk>`` = 0).

Sample building: :mod:`msllm.data.samples` (re-exported here).

``qa``: each conversation rendered by a prompt template (:func:`build_qa_sample`; the command
line's default ``vicuna_v1.1`` gives MindFormers' samples, ``alpaca`` this module's earlier
layout) and tokenised by :func:`msllm.data.templates.encode_segments`: all turns of a
conversation go into one sample; labels keep every answer and its ``</s>``, the rest is
:data:`IGNORE_INDEX`. As in MindFormers, one leading non-human turn is dropped. Longer than
``seq_length + 1`` -> truncated (kept, counted); nothing left to learn -> skipped with reason
:data:`SKIP_NO_RESPONSE` (MindFormers writes such rows with every label ignored).

``wiki``: documents (:mod:`msllm.data.wiki`: text lines, ``text`` of ``.json``/``.jsonl``
records, or WikiText paragraphs cleaned as MindFormers does) are tokenised with
``encode_special`` and concatenated as ``[bos] + doc + [eos]`` per document, then cut into
blocks of ``seq_length + 1``; the final partial block is dropped (its size is reported).
``labels = input_ids``. This is MindFormers' ``tokenize_wiki`` stream (``tokenizer(para)`` with
BOS and EOS, ``chunks`` of ``seq_length + 1``, the short last chunk dropped), except that
MindFormers repeats the token stream before cutting while msllm repeats the blocks.

Then the first ``samples_num`` samples are kept (if given), the list is repeated ``repeat``
times and, if ``shuffle``, permuted with ``numpy.random.default_rng(seed)``; MindFormers'
script does not shuffle (``--shuffle 0`` writes its row order).

Tokenization can run in ``num_workers`` processes (``spawn`` start method, ordered
``Pool.imap`` over chunks of 64 conversations, each encoded in one batch call of an HF tokenizer;
the tokenizer is loaded once per worker by the pool initializer); the result is
identical for any number of workers.
"""

from __future__ import annotations

import dataclasses
import glob
import multiprocessing
import os
import time
from typing import Callable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from msllm.data.conversation import load_conversation_file
from msllm.data.mindrecord import DB_SUFFIX, SIDECAR_FORMAT, SIDECAR_SUFFIX, shard_paths, write_mindrecord
from msllm.data.samples import (LIBRARY_TEMPLATE, SKIP_NO_RESPONSE, BlockPacker, QAResult,  # noqa: F401 (re-exported)
                                build_qa_sample, build_qa_samples, pack_documents, pad_sample, sample_order)
from msllm.data.templates import IGNORE_INDEX, resolve_template  # noqa: F401 (IGNORE_INDEX re-exported)
from msllm.data.tokenizer import load_tokenizer
from msllm.data.wiki import read_wiki_documents, read_wiki_file  # noqa: F401  (re-exported)
from msllm.errors import MsllmError

DATASET_TYPES = ("qa", "wiki")


# --------------------------------------------------------------------------------------------
# Input reading
# --------------------------------------------------------------------------------------------


def expand_input_glob(pattern: str) -> list[str]:
    """Sorted absolute paths of the files matching ``pattern`` (``**`` allowed).

    Raises:
        MsllmError: nothing (no regular file) matches.
    """
    files = sorted(os.path.abspath(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise MsllmError(f"--input_glob {pattern!r} matches no files (expected at least one input file)")
    return files


# --------------------------------------------------------------------------------------------
# Parallel tokenization
# --------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(model_file: str, pad_token_id: int, seq_length: int, template: str = LIBRARY_TEMPLATE) -> None:
    """Pool initializer: load the tokenizer once per process."""
    _WORKER["tokenizer"] = load_tokenizer(model_file, pad_token_id)
    _WORKER["seq_length"] = seq_length
    _WORKER["template"] = resolve_template(template, _WORKER["tokenizer"])


QA_CHUNK = 64   # conversations per task: one batch call of the HF tokenizer (its thread pool)


def _qa_chunk_task(chunk: list[list[tuple[str, str]]]) -> list:
    return build_qa_samples(_WORKER["tokenizer"], chunk, _WORKER["seq_length"], _WORKER["template"])


def _wiki_task(text: str) -> np.ndarray:
    # MindFormers calls its tokenizer on the text: special-token strings are tokens
    return np.asarray(_WORKER["tokenizer"].encode_special(text), np.int32)


def ordered_map(
    fn: Callable, items: Sequence, num_workers: int, initargs: tuple, chunksize: int | None = None
) -> Iterator:
    """``map(fn, items)`` in order, in this process (``num_workers <= 1``) or in a ``spawn``
    pool of ``num_workers`` processes initialised by ``_init_worker(*initargs)``.

    ``spawn`` (not ``fork``) so that workers never inherit threads (e.g. from an already
    imported MindSpore) and behave the same on every platform.
    """
    if num_workers <= 1:
        _init_worker(*initargs)
        yield from map(fn, items)
        return
    if chunksize is None:
        chunksize = max(1, min(256, len(items) // (num_workers * 8)))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(num_workers, initializer=_init_worker, initargs=initargs) as pool:
        yield from pool.imap(fn, items, chunksize=chunksize)


# --------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PreprocessSummary:
    """Counts and timings of one preprocessing run (returned by :func:`preprocess_to_mindrecord`).

    ``truncated``/``skipped`` count conversations (before ``repeat``); ``tokens_written`` counts
    non-padding tokens and ``loss_tokens`` the targets ``labels[1:] != IGNORE_INDEX`` over all
    written rows (after ``repeat``). Times are wall-clock seconds.
    """

    output_file: str
    dataset_type: str
    seq_length: int
    input_files: list[str]
    template: str | None = None
    data_files: list[str] = dataclasses.field(default_factory=list)
    wikitext_files: int = 0
    samples_num: int | None = None
    not_used: int = 0
    records_read: int = 0
    samples_built: int = 0
    samples_written: int = 0
    tokens_written: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped_tail_tokens: int = 0
    packing: dict | None = None   # --pack: rows, documents, max_documents_per_row (msllm.data.packing)
    num_workers: int = 1
    tokenize_seconds: float = 0.0
    write_seconds: float = 0.0
    import_seconds: float = 0.0
    total_seconds: float = 0.0

    def counts(self) -> dict:
        """The run-independent counts (stored in the sidecar under ``counts``)."""
        return {
            "records_read": self.records_read,
            "samples_built": self.samples_built,
            "samples_written": self.samples_written,
            "tokens_written": self.tokens_written,
            "loss_tokens": self.loss_tokens,
            "truncated": self.truncated,
            "skipped": dict(sorted(self.skipped.items())),
            "dropped_tail_tokens": self.dropped_tail_tokens,
            "not_used_samples_num": self.not_used,
        }

    def format(self) -> str:
        """Human-readable multi-line summary."""
        t = max(self.total_seconds, 1e-9)
        tk = max(self.tokenize_seconds, 1e-9)
        skipped = sum(self.skipped.values())
        kind = self.dataset_type
        if self.template is not None:
            kind += f", template {self.template}"
        if self.wikitext_files:
            kind += f", {self.wikitext_files} WikiText file(s) cleaned as MindFormers' clean_wikitext"
        lines = [
            f"input files       : {len(self.input_files)} ({kind})",
            f"records read      : {self.records_read}",
            f"samples built     : {self.samples_built}",
            f"samples written   : {self.samples_written} (seq_length {self.seq_length}, rows of {self.seq_length + 1})",
            f"tokens written    : {self.tokens_written} (non-padding)",
            f"loss tokens       : {self.loss_tokens} (labels[1:] != {IGNORE_INDEX})",
            f"truncated         : {self.truncated}",
            f"skipped           : {skipped}",
        ]
        for reason, n in sorted(self.skipped.items()):
            lines.append(f"  {n:>6}  {reason}")
        if self.samples_num is not None:
            lines.append(f"--samples_num     : {self.samples_num} kept, {self.not_used} more built and not used")
        if self.packing is not None:
            p = self.packing
            lines.append(f"packed            : {p['documents']} conversations in {p['rows']} rows "
                         f"(up to {p['max_documents_per_row']} per row, column actual_seq_len); padding "
                         f"{1 - self.tokens_written / max(p['rows'] * (self.seq_length + 1), 1):.1%} of the slots")
        if self.dataset_type == "wiki":
            lines.append(f"dropped tail      : {self.dropped_tail_tokens} tokens (final partial block)")
        files = self.data_files or [self.output_file]
        where = files[0] if len(files) == 1 else f"{len(files)} shards {files[0]} ... {files[-1]}"
        lines += [
            f"output            : {where} (+ .db, + .json sidecar each)",
            f"time              : {self.total_seconds:.2f} s total, tokenize {self.tokenize_seconds:.2f} s "
            f"({self.num_workers} worker(s)), MindSpore import {self.import_seconds:.2f} s, "
            f"write {self.write_seconds:.2f} s",
            f"throughput        : {self.records_read / t:.0f} records/s, {self.tokens_written / t:.0f} tokens/s "
            f"overall; tokenize {self.records_read / tk:.0f} records/s",
        ]
        return "\n".join(lines)


def _validate_args(dataset_type: str, seq_length: int, repeat: int, num_workers: int, output_file: str,
                   file_partition: int, samples_num: int | None) -> None:
    if dataset_type not in DATASET_TYPES:
        raise MsllmError(f"--dataset_type {dataset_type!r}: expected one of {', '.join(DATASET_TYPES)}")
    if seq_length < 2:
        raise MsllmError(f"--seq_length {seq_length}: expected an integer >= 2")
    if repeat < 1:
        raise MsllmError(f"--repeat {repeat}: expected an integer >= 1")
    if num_workers < 1:
        raise MsllmError(f"--num_workers {num_workers}: expected an integer >= 1")
    if not 1 <= file_partition <= 1000:
        raise MsllmError(f"--file_partition {file_partition}: expected an integer in [1, 1000]")
    if samples_num is not None and samples_num < 1:
        raise MsllmError(f"--samples_num {samples_num}: expected an integer >= 1")
    base = os.path.basename(output_file)
    if not base or base.startswith(".") or output_file.endswith((DB_SUFFIX, SIDECAR_SUFFIX)):
        raise MsllmError(f"--output_file {output_file!r}: expected a file name such as alpaca.mindrecord "
                         f"(not ending in {DB_SUFFIX} or {SIDECAR_SUFFIX}, the companions' suffixes)")
    if os.path.isdir(output_file):
        raise MsllmError(f"--output_file {output_file!r} is a directory (expected a file name)")


def preprocess_to_mindrecord(
    input_glob: str,
    dataset_type: str,
    model_file: str,
    seq_length: int,
    output_file: str,
    repeat: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 1,
    pad_token_id: int = 0,
    progress: bool = True,
    template: str | None = None,
    file_partition: int = 1,
    samples_num: int | None = None,
    pack: bool = False,
) -> PreprocessSummary:
    """Tokenize the inputs matching ``input_glob`` and write ``output_file`` (a MindRecord with
    int32 ``input_ids``/``labels`` rows of ``seq_length + 1``, its ``.db`` and ``.json`` sidecar;
    ``file_partition`` > 1: the shards ``output_file + "0"`` ... each with both).

    Args: see ``data_preprocess/llama_preprocess.py --help``; ``progress`` shows tqdm bars;
    ``template``: ``qa`` only, ``None`` = :data:`LIBRARY_TEMPLATE`; recorded in the sidecar.
    ``pack`` (``qa`` only): whole conversations packed greedily into the rows, with MindFormers'
    ``actual_seq_len`` column beside ``input_ids`` / ``labels`` (:mod:`msllm.data.packing`); the
    order (repeat, shuffle) is decided first, then packed.

    Returns:
        The :class:`PreprocessSummary`.

    Raises:
        MsllmError: bad arguments (seq_length < 2, repeat < 1, num_workers < 1, file_partition
            outside [1, 1000], samples_num < 1, unknown dataset_type or template, a template for
            wiki, output name a directory or ending in .db/.json, pad id outside the
            vocabulary), ``model_file`` is not a tokenizer (:func:`~msllm.data.tokenizer.load_tokenizer`:
            a SentencePiece ``.model``, a ``tokenizer.json`` or an HF model directory), a chat
            template that fails on a conversation (naming it), the glob matches nothing,
            an input file is malformed (file/record/key named), or no sample could be built.
            All inputs are read and validated before anything is written; output is atomic.
    """
    t_start = time.perf_counter()
    _validate_args(dataset_type, seq_length, repeat, num_workers, output_file, file_partition, samples_num)
    if pack and dataset_type != "qa":
        raise MsllmError(f"--pack applies to --dataset_type qa only (got {dataset_type}: wiki rows are already full)")
    if dataset_type == "wiki" and template is not None:
        raise MsllmError(f"--template {template!r} applies to --dataset_type qa only (wiki text has no turns)")
    template_name = (template or LIBRARY_TEMPLATE) if dataset_type == "qa" else None
    tokenizer = load_tokenizer(model_file, pad_token_id)
    if template_name is not None:   # unknown name, or no chat template -> error before any work
        template_name = resolve_template(template_name, tokenizer).name
    files = expand_input_glob(input_glob)
    summary = PreprocessSummary(
        output_file=os.path.abspath(output_file),
        dataset_type=dataset_type,
        seq_length=seq_length,
        input_files=files,
        num_workers=num_workers,
        template=template_name,
        samples_num=samples_num,
        data_files=shard_paths(os.path.abspath(output_file), file_partition),
    )

    items: list = []
    origins: list[tuple[int, str]] = []   # (first item index, file) per input file, for error messages
    for path in files:
        origins.append((len(items), path))
        if dataset_type == "qa":
            items.extend(load_conversation_file(path))
        else:
            docs, wikitext = read_wiki_file(path)
            items.extend(docs)
            summary.wikitext_files += int(wikitext)
    summary.records_read = len(items)
    if not items:
        raise MsllmError(f"--input_glob {input_glob!r}: the {len(files)} matching file(s) hold no records")

    t_tok = time.perf_counter()
    initargs = (model_file, pad_token_id, seq_length, template_name or LIBRARY_TEMPLATE)
    samples: list[tuple[np.ndarray, np.ndarray]] = []
    bar = tqdm(total=len(items), desc="tokenize", unit="rec", disable=not progress)
    try:
        if dataset_type == "qa":
            chunks = [items[k:k + QA_CHUNK] for k in range(0, len(items), QA_CHUNK)]
            results = (r for chunk in ordered_map(_qa_chunk_task, chunks, num_workers, initargs, chunksize=1)
                       for r in chunk)
            for i in range(len(items)):
                res = next(results)
                if isinstance(res, MsllmError):   # e.g. a chat template refusing this conversation
                    first, path = max(o for o in origins if o[0] <= i)
                    raise MsllmError(f"{path}: conversation {i - first}: {res}") from None
                bar.update(1)
                summary.truncated += int(res.truncated and res.skip_reason is None)
                if res.skip_reason is not None:
                    summary.skipped[res.skip_reason] = summary.skipped.get(res.skip_reason, 0) + 1
                    continue
                samples.append((res.input_ids, res.labels))
        else:
            packer = BlockPacker(seq_length + 1, tokenizer.bos_id if tokenizer.add_bos else None, tokenizer.eos_id)
            for ids in ordered_map(_wiki_task, items, num_workers, initargs):
                bar.update(1)
                for block in packer.add(ids):
                    samples.append((block, block))
            summary.dropped_tail_tokens = packer.pending
    finally:
        bar.close()
    summary.tokenize_seconds = time.perf_counter() - t_tok
    summary.samples_built = len(samples)
    if not samples:
        if dataset_type == "wiki":
            raise MsllmError(
                f"--input_glob {input_glob!r}: the {summary.records_read} documents give only "
                f"{summary.dropped_tail_tokens} tokens, fewer than one block of seq_length + 1 = "
                f"{seq_length + 1} (expected more text or a smaller --seq_length)"
            )
        raise MsllmError(
            f"--input_glob {input_glob!r}: all {summary.records_read} conversations were skipped "
            f"({summary.skipped}); expected at least one usable human/gpt conversation"
        )
    if samples_num is not None and len(samples) > samples_num:
        summary.not_used = len(samples) - samples_num
        samples = samples[:samples_num]

    order = sample_order(len(samples), repeat, shuffle, seed)
    lengths = np.array([s[0].shape[0] for s in samples], np.int64)
    loss = np.array([int(np.count_nonzero(s[1][1:] != IGNORE_INDEX)) for s in samples], np.int64)
    summary.samples_written = int(order.shape[0])
    summary.tokens_written = int(lengths[order].sum())
    summary.loss_tokens = int(loss[order].sum())
    packed = None
    if pack:   # the order first (repeat, shuffle), then whole documents into rows in that order
        from msllm.data.packing import PACKED_COLUMN, pack_samples, packing_stats

        packed = pack_samples((samples[int(i)] for i in order), seq_length, pad_token_id)
        summary.packing = packing_stats(packed, pad_token_id)
        summary.samples_written = len(packed)

    meta = {
        "format": SIDECAR_FORMAT,
        "seq_length": seq_length,
        "sample_length": seq_length + 1,
        "dataset_type": dataset_type,
        "pad_token_id": pad_token_id,
        "ignore_index": IGNORE_INDEX,
        "tokenizer_md5": tokenizer.md5(),
        "tokenizer_file": os.path.abspath(tokenizer.model_file),
        "tokenizer_kind": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "num_samples": summary.samples_written,
        "columns": {"input_ids": "int32", "labels": "int32", **({PACKED_COLUMN: "int32"} if pack else {})},
        "packing": summary.packing,
        "input_files": files,
        "repeat": repeat,
        "shuffle": bool(shuffle),
        "seed": seed,
        "counts": summary.counts(),
        "template": template_name,
        "wikitext_files": summary.wikitext_files if dataset_type == "wiki" else None,
        # file_partition and data_files are added by write_mindrecord
    }

    def rows() -> Iterator[tuple[np.ndarray, ...]]:
        if packed is not None:
            yield from tqdm(packed, desc="write", unit="row", disable=not progress)
            return
        for idx in tqdm(order, desc="write", unit="sample", disable=not progress):
            ids, lab = samples[int(idx)]
            yield pad_sample(ids, lab, seq_length, pad_token_id)

    t_import = time.perf_counter()
    import mindspore.mindrecord  # noqa: F401  (~1.5 s; timed apart from the writing itself)

    t_write = time.perf_counter()
    summary.import_seconds = t_write - t_import
    schema = None
    if pack:
        schema = {name: {"type": "int32", "shape": [-1]} for name in ("input_ids", "labels", PACKED_COLUMN)}
    write_mindrecord(output_file, rows(), meta=meta, shard_num=file_partition, schema=schema)
    summary.write_seconds = time.perf_counter() - t_write
    summary.total_seconds = time.perf_counter() - t_start
    return summary
