"""Perplexity: of text files (sliding window, :mod:`msllm.eval.tasks.ppl`), of an evaluation
MindRecord (``run_mode: eval``), and the evaluation loss during training (``do_eval``).

Definition (all three): the token-weighted mean negative log-likelihood over the scored tokens,
``mean_nll = -sum_i log p(t_i | t_<i) / N``, and ``ppl = exp(mean_nll)``. For a MindRecord the
scored tokens are the label tokens (``labels[1:] != ignore_token_id``, the tokens the training loss
counts; sample layout of ``llama_preprocess``: ``input_ids[:-1]`` predict ``labels[1:]``).

MindFormers' ``PerplexityMetric`` (``mindformers/core/metric/metric.py``) averages per-batch mean
losses instead; with batches of different label counts the two differ, and msllm's is the
per-token definition (the one the HF perplexity guide and lm-eval use).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from msllm.errors import MsllmError
from msllm.eval.requests import Row
from msllm.eval.scoring import score_rows, scorer_for
from msllm.eval.tasks.ppl import windows


def text_rows(documents: Sequence[Sequence[int]], max_length: int, stride: int) -> tuple[list[Row], list[int]]:
    """Rows of the sliding windows over token ``documents`` (each starting with BOS).

    Returns (rows, doc_of_query): query k (= row k) scores window k, of document doc_of_query[k].
    """
    rows, owner = [], []
    for d, ids in enumerate(documents):
        for begin, end, n in windows(len(ids), max_length + 1, stride):
            window = list(ids[begin:end])
            tokens = tuple(window[:-1])
            rows.append(Row(tokens, [(len(rows), list(range(len(tokens) - n, len(tokens))), window[-n:])]))
            owner.append(d)
    return rows, owner


def record_rows(input_ids: np.ndarray, labels: np.ndarray, ignore: int) -> list[Row]:
    """Rows of MindRecord samples (N, T + 1): tokens ``input_ids[:-1]``, targets ``labels[1:]``
    where not ``ignore``. Samples with no target are kept with no query (they count 0 tokens)."""
    rows = []
    for i in range(input_ids.shape[0]):
        tgt = labels[i, 1:]
        pos = np.nonzero(tgt != ignore)[0]
        queries = [(i, pos.tolist(), tgt[pos].tolist())] if pos.size else []
        rows.append(Row(tuple(input_ids[i, :-1].tolist()), queries))
    return [r for r in rows if r.queries]


def summarise(scores: dict, queries: Optional[Sequence[int]] = None) -> dict:
    """``{"tokens", "nll_sum", "mean_nll", "ppl"}`` over ``queries`` (default all), summed in
    query order (float64)."""
    keys = sorted(scores) if queries is None else list(queries)
    nll = float(sum(-scores[k][0] for k in keys))
    n = int(sum(scores[k][2] for k in keys))
    mean = nll / n if n else float("nan")
    return {"tokens": n, "nll_sum": nll, "mean_nll": mean, "ppl": math.exp(mean) if n else float("nan")}


def read_eval_records(dataset_dir: str, seq_length: int, input_columns=("input_ids", "labels"),
                      pad_token_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` and ``labels`` (N, seq_length + 1) int32 of every MindRecord file under
    ``dataset_dir`` (checked like the training data: :func:`msllm.data.mindrecord.check_dataset`).

    ``input_columns`` (``eval_dataset.input_columns``) as for training: ``["input_ids"]`` scores
    every token after a non-padding one (:func:`msllm.data.dataset.labels_from_input_ids`) instead of
    the file's labels.

    Packed files (``llama_preprocess.py --pack``, or MindFormers' packed rows with
    ``actual_seq_len``) are read back as one row per document
    (:func:`msllm.data.packing.read_packed_documents`): every document is scored exactly as in an
    unpacked file, so the perplexity is the same.

    Raises:
        MsllmError: empty ``dataset_dir``, bad ``input_columns``, or a file the checks refuse.
    """
    from msllm.data.dataset import check_input_columns, labels_from_input_ids
    from msllm.data.mindrecord import check_dataset, read_mindrecord_arrays

    if not dataset_dir:
        raise MsllmError("eval_dataset.dataset_dir is empty: point it at an evaluation .mindrecord file or "
                         "directory (data_preprocess/llama_preprocess.py), e.g. --eval_dataset_dir X")
    read_labels = check_input_columns(input_columns, "eval_dataset.input_columns")
    from msllm.data.mindrecord import check_mindrecord
    from msllm.data.packing import read_packed_documents

    ids, labels = [], []
    for f in check_dataset(dataset_dir, seq_length):
        layout = check_mindrecord(f, seq_length)["layout"]
        if layout != "rows":   # packed: each document scored as its own row (msllm.data.packing)
            if not read_labels:
                raise MsllmError(f"{f}: packed rows need their labels column (eval_dataset.input_columns "
                                 "[\"input_ids\", \"labels\"])")
            a, b = read_packed_documents(f, layout, seq_length, pad_token_id)
            ids.append(a)
            labels.append(b)
            continue
        arrays = read_mindrecord_arrays(f)
        ids.append(arrays["input_ids"])
        labels.append(arrays["labels"] if read_labels else labels_from_input_ids(arrays["input_ids"], pad_token_id))
    return np.concatenate(ids), np.concatenate(labels)


def evaluate_loss(network, eval_data, batch_size: int = 8, rank: int = 0, world_size: int = 1,
                  ignore_token_id: int = -100, pad_id: int = 0) -> tuple[float, float, int]:
    """Evaluation loss of ``network`` (a ``LlamaForCausalLM``, e.g. the one being trained) on
    ``eval_data``: a path to an evaluation MindRecord, or ``(input_ids, labels)`` arrays
    (N, seq_length + 1) as :func:`read_eval_records` returns.

    Data parallel: pass this process's ``rank`` and the ``world_size``; the samples are split
    over the ranks and the result, identical on every rank, equals a single-process run's.
    Returns ``(mean_nll, ppl, tokens)``: token-weighted mean negative log-likelihood of the label
    tokens, its exp, and how many tokens were counted.
    """
    if isinstance(eval_data, str):
        eval_data = read_eval_records(eval_data, network.config.seq_length)
    input_ids, labels = eval_data
    rows = record_rows(np.asarray(input_ids), np.asarray(labels), ignore_token_id)
    if not rows:
        raise MsllmError("evaluation data has no label tokens (every label is ignore_token_id)")
    s = summarise(score_rows(scorer_for(network, batch_size, pad_id, 0, set_eval=False), rows, rank, world_size))
    return s["mean_nll"], s["ppl"], s["tokens"]
