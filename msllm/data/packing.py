"""Packing whole conversations into training rows (``llama_preprocess.py --dataset_type qa --pack``).

Without packing every conversation is one row padded to ``seq_length + 1``; with short
instructions most of a long row is padding. Packing puts several whole conversations
("documents") into one row, and records where each ends, so that the model can keep them apart.

The rule (one place; :func:`pack_samples`):

* **Greedy, in order, whole documents** (MindFormers' ``PackingHandler`` ``pack`` strategy,
  ``mindformers/dataset/handler/packing_handler.py`` ``pack_examples``: a sample is appended to the
  open row while it fits, otherwise the row is closed and a new one opened; MindSpeed-LLM's
  ``--pack``). A document is never split; one longer than the row was already truncated to
  ``seq_length + 1`` by the sample builder (as unpacked rows are), so it fills a row alone.
* **Rows of ``seq_length + 1``** (msllm's row layout: ``tokens = input_ids[:-1]``,
  ``targets = labels[1:]``): documents occupy ``[s_i, e_i)`` one after another from slot 0,
  ``e_last <= seq_length + 1``; the rest is ``pad_token_id`` / :data:`IGNORE_INDEX`.
* **``actual_seq_len``** (MindFormers' column name and meaning: the cumulative end of each
  document over the row's ``seq_length`` model positions, without the leading 0; MindFormers'
  ``HFDataset._iter_packed_data`` in ``mindformers/dataset/dataloader/hf_dataloader.py`` builds
  position ids and the causal mask per document from it): ``[min(e_1, T), ..., min(e_n, T)]``
  with ``T = seq_length``. The last document may reach slot ``T`` (its last token is then only
  a target), so its end is written as ``T``. Positions after the last end (padding) form one more
  segment, as in MindFormers.
* **No label crosses a document**: the label at every document's first slot is set to
  :data:`IGNORE_INDEX`. That label is the target of the previous document's last token; in the
  unpacked row it is never a target (``labels[0]`` is dropped), so every document keeps exactly
  its unpacked targets. The model applies the same rule from ``actual_seq_len`` alone
  (:func:`msllm.models.llama.batch_layout.document_targets`), so rows written by other tools
  cannot leak either.

MindFormers' own packed rows differ in layout (rows of ``seq_length`` with labels already
shifted, see :func:`from_mindformers_row`); msllm reads them as they are.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from msllm.data.templates import IGNORE_INDEX
from msllm.errors import MsllmError

PACKED_COLUMN = "actual_seq_len"


def pack_samples(samples: Iterable[tuple[np.ndarray, np.ndarray]], seq_length: int,
                 pad_token_id: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Greedy in-order packing of whole documents (module doc).

    Args:
        samples: ``(input_ids, labels)`` pairs, each (n,) int32 with ``1 <= n <= seq_length + 1``.
        seq_length: the model's sequence length T; rows hold T + 1 slots.
        pad_token_id: padding id of ``input_ids``.

    Returns:
        Rows ``(input_ids (T+1,) int32, labels (T+1,) int32, actual_seq_len (n_docs,) int32)``.

    Raises:
        MsllmError: a sample is empty or longer than ``seq_length + 1`` (the sample builder
            truncates; anything else is a caller's bug), or ids and labels differ in length.
    """
    cap = seq_length + 1
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    open_docs: list[tuple[np.ndarray, np.ndarray]] = []
    used = 0
    for k, (ids, lab) in enumerate(samples):
        n = int(len(ids))
        if n != len(lab) or not 1 <= n <= cap:
            raise MsllmError(f"packing: sample {k} has {n} input_ids and {len(lab)} labels "
                             f"(expected equal lengths in [1, seq_length + 1 = {cap}])")
        if used + n > cap:
            rows.append(_close_row(open_docs, seq_length, pad_token_id))
            open_docs, used = [], 0
        open_docs.append((np.asarray(ids, np.int32), np.asarray(lab, np.int32)))
        used += n
    if open_docs:
        rows.append(_close_row(open_docs, seq_length, pad_token_id))
    return rows


def _close_row(docs: Sequence[tuple[np.ndarray, np.ndarray]], seq_length: int, pad_token_id: int):
    ids = np.full(seq_length + 1, pad_token_id, np.int32)
    lab = np.full(seq_length + 1, IGNORE_INDEX, np.int32)
    ends = []
    s = 0
    for d_ids, d_lab in docs:
        e = s + len(d_ids)
        ids[s:e] = d_ids
        lab[s:e] = d_lab
        lab[s] = IGNORE_INDEX           # the previous document's last token predicts nothing
        ends.append(min(e, seq_length))
        s = e
    return ids, lab, np.asarray(ends, np.int32)


def from_mindformers_row(input_ids: np.ndarray, labels: np.ndarray, actual_seq_len: np.ndarray,
                         pad_token_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One MindFormers packed row -> msllm's row layout.

    MindFormers' ``PackingHandler`` writes rows of ``seq_length`` T: ``input_ids`` the documents
    one after another, ``labels`` already shifted (``labels[t]`` is the target of
    ``input_ids[t]``: each document's labels ``[1:]`` plus ``pad_token`` at its last token) and
    ``actual_seq_len`` the cumulative ends. msllm's rows are T + 1 long with
    ``targets = labels[1:]``: ``input_ids`` gets one pad slot at the end and ``labels`` one
    ignored slot at the front. The target MindFormers writes at each document's last token (its
    ``pad_token``, a real token id) becomes :data:`IGNORE_INDEX`: in an unpacked row a
    conversation's last token has no target, and counting a pad target would change the loss.

    Returns (input_ids (T+1,), labels (T+1,), actual_seq_len (n,)) int32.

    Raises:
        MsllmError: lengths differ, or ``actual_seq_len`` is not increasing within (0, T].
    """
    ids = np.asarray(input_ids, np.int32)
    lab = np.asarray(labels, np.int32).copy()
    ends = np.asarray(actual_seq_len, np.int64).reshape(-1)
    t = ids.shape[0]
    check_actual_seq_len(ends, t, "MindFormers packed row")
    if lab.shape[0] != t:
        raise MsllmError(f"MindFormers packed row: input_ids has {t} values, labels {lab.shape[0]} (expected equal)")
    lab[ends[ends > 0] - 1] = IGNORE_INDEX
    out_ids = np.concatenate([ids, np.asarray([pad_token_id], np.int32)])
    out_lab = np.concatenate([np.asarray([IGNORE_INDEX], np.int32), lab])
    return out_ids, out_lab, ends.astype(np.int32)


def check_actual_seq_len(ends: np.ndarray, seq_length: int, where: str) -> None:
    """Raise MsllmError (naming ``where``) unless ``ends`` is non-decreasing within [1, seq_length]
    (repeated values, MindFormers' padding with ``seq_length``, are allowed)."""
    ends = np.asarray(ends).reshape(-1)
    if ends.size == 0 or ends.min() < 1 or ends.max() > seq_length or np.any(np.diff(ends) < 0):
        raise MsllmError(f"{where}: actual_seq_len {ends.tolist()[:16]} is not a non-decreasing list of "
                         f"document ends in [1, {seq_length}] (expected MindFormers' cumulative lengths)")


def pad_actual_seq_len(ends: np.ndarray, width: int, seq_length: int) -> np.ndarray:
    """(n,) document ends -> (width,) int32 padded with ``seq_length`` (MindFormers' padding of
    ``actual_seq_len`` to ``compressed_eod_mask_length``: a padded end is an empty document).

    Raises MsllmError if n > width."""
    ends = np.asarray(ends, np.int32).reshape(-1)
    if ends.shape[0] > width:
        raise MsllmError(f"a packed row holds {ends.shape[0]} documents, more than the {width} this run's "
                         "batches have room for")
    return np.concatenate([ends, np.full(width - ends.shape[0], seq_length, np.int32)])


def packing_stats(rows: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], pad_token_id: int) -> dict:
    """Counts of packed rows: ``rows``, ``documents``, ``max_documents_per_row``."""
    docs = [int(r[2].shape[0]) for r in rows]
    return {"rows": len(rows), "documents": int(sum(docs)), "max_documents_per_row": int(max(docs, default=0))}


def unpack_row(input_ids: np.ndarray, labels: np.ndarray, actual_seq_len: np.ndarray, pad_token_id: int):
    """The documents of one packed row in msllm's layout (T + 1 slots), each as its own
    ``(input_ids (n,), labels (n,))``: the inverse of :func:`pack_samples` (evaluation scores
    them as unpacked rows, so a packed file's perplexity is the unpacked file's by construction).

    Document i covers slots ``[s_i, e_i)``; the one ending at T also takes slot T (its last
    target) unless slot T is padding (``pad_token_id`` with an ignored label); padding after the last end is no document. A document's first label is dropped to
    :data:`IGNORE_INDEX` (never a target in a row of its own)."""
    ids = np.asarray(input_ids, np.int32)
    lab = np.asarray(labels, np.int32)
    t = ids.shape[0] - 1
    ends = np.asarray(actual_seq_len, np.int64).reshape(-1)
    check_actual_seq_len(ends, t, "packed row")
    out, s = [], 0
    for e in ends:
        e = int(e)
        if e <= s:                      # a padded (empty) entry
            continue
        # slot T belongs to the document ending at T unless it is padding (a pad id without target)
        stop = t + 1 if e == t and not (ids[t] == pad_token_id and lab[t] == IGNORE_INDEX) else e
        d_lab = lab[s:stop].copy()
        d_lab[0] = IGNORE_INDEX
        out.append((ids[s:stop].copy(), d_lab))
        s = e
    return out


def read_packed_documents(path: str, layout: str, seq_length: int, pad_token_id: int):
    """Every document of the packed MindRecord ``path`` (``layout`` "packed" or
    "mindformers_packed", :func:`msllm.data.mindrecord.check_mindrecord`) as unpacked rows:
    (input_ids, labels) (N, seq_length + 1) int32, padded with ``pad_token_id`` / IGNORE_INDEX.

    Raises:
        MsllmError: the file cannot be read, or a row's ``actual_seq_len`` is not valid (naming the file).
    """
    from mindspore.mindrecord import FileReader

    try:
        reader = FileReader(path, num_consumer=1, columns=["input_ids", "labels", PACKED_COLUMN])
    except (RuntimeError, ValueError, TypeError) as exc:
        raise MsllmError(f"{path}: cannot open MindRecord ({str(exc).strip().splitlines()[0]})") from None
    ids_out, lab_out = [], []
    try:
        for k, row in enumerate(reader.get_next()):
            ids, lab, ends = row["input_ids"], row["labels"], row[PACKED_COLUMN]
            try:
                if layout == "mindformers_packed":
                    ids, lab, ends = from_mindformers_row(ids, lab, ends, pad_token_id)
                docs = unpack_row(ids, lab, ends, pad_token_id)
            except MsllmError as exc:
                raise MsllmError(f"{path}: row {k}: {exc}") from None
            for d_ids, d_lab in docs:
                row_ids = np.full(seq_length + 1, pad_token_id, np.int32)
                row_lab = np.full(seq_length + 1, IGNORE_INDEX, np.int32)
                row_ids[:len(d_ids)], row_lab[:len(d_lab)] = d_ids, d_lab
                ids_out.append(row_ids)
                lab_out.append(row_lab)
    finally:
        reader.close()
    return np.stack(ids_out), np.stack(lab_out)


__all__ = ["PACKED_COLUMN", "unpack_row", "read_packed_documents", "pack_samples", "from_mindformers_row", "check_actual_seq_len",
           "pad_actual_seq_len", "packing_stats"]
