"""The training input pipeline: MindRecord files -> this rank's batches, in an order that is a pure
function of (seed, epoch, rank), so a resumed run takes exactly the batches the uninterrupted
run would have taken.

Order: each epoch e draws one global permutation of all N samples from
``numpy.random.default_rng([seed, e])`` (or keeps file order without shuffle); data-parallel
rank r of W takes every W-th sample starting at r. Every rank gets ``N // W`` samples (the last
``N mod W`` of the permutation are left out that epoch) so all ranks run the same number of
steps, which data parallel needs: a rank with one more batch would wait forever in the
gradient all-reduce. The samples are read with ``MindDataset(sampler=SubsetSampler(indices))``
(MindSpore doc "mindspore.dataset.MindDataset"), which keeps the given order.

Columns (MindFormers' ``input_columns``): ``["input_ids", "labels"]`` (default) reads both;
``["input_ids"]`` ignores the file's labels and trains on every token whose *input* position is
not padding, which is what MindFormers' ``LlamaForCausalLM.construct`` does without labels
(``labels = input_ids[:, 1:]``, ``input_mask = tokens != pad_token_id``; mindformers r1.0
``mindformers/models/llama/llama.py``, commit 6a4076003f0c2461637b477199844cb92774e4d1):
:func:`labels_from_input_ids`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from msllm.data.mindrecord import COLUMNS, check_dataset
from msllm.data.templates import IGNORE_INDEX
from msllm.errors import MsllmError


def labels_from_input_ids(input_ids: np.ndarray, pad_token_id: int) -> np.ndarray:
    """Labels for ``input_columns: ["input_ids"]``: (L,) int32 -> (L,) int32 with
    ``labels[t] = input_ids[t]`` where ``input_ids[t - 1] != pad_token_id``, else -100 (and
    ``labels[0] = -100``, which the trainer never reads: targets are ``labels[1:]``).

    Same targets as MindFormers without a labels column (see the module doc); note that this
    keeps the first pad after the last real token as a target, as MindFormers does.
    """
    ids = np.asarray(input_ids)
    out = np.full(ids.shape, IGNORE_INDEX, np.int32)
    keep = ids[..., :-1] != pad_token_id
    out[..., 1:] = np.where(keep, ids[..., 1:], IGNORE_INDEX)
    return out


def check_input_columns(input_columns, where: str = "train_dataset.input_columns") -> bool:
    """``True`` if the labels are read from the file, ``False`` if derived from ``input_ids``.

    Raises:
        MsllmError: anything but ``["input_ids", "labels"]`` (either order) or ``["input_ids"]``.
    """
    cols = list(input_columns)
    if sorted(cols) == ["input_ids", "labels"]:
        return True
    if cols == ["input_ids"]:
        return False
    raise MsllmError(f"{where}={cols!r}: expected [\"input_ids\", \"labels\"] (train on the labels "
                     "written by llama_preprocess.py) or [\"input_ids\"] (train on every non-padding "
                     "token, as MindFormers does without labels)")


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Global sample order of ``epoch`` (0-based): (num_samples,) int64 permutation."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


@dataclass
class TrainData:
    """This rank's view of the training set.

    ``steps_per_epoch`` batches of ``batch_size`` samples per epoch; each batch is
    ``input_ids`` and ``labels``, both (batch_size, seq_length + 1) int32, and for packed files
    (:mod:`msllm.data.packing`; ``layout`` "packed" or "mindformers_packed") also
    ``actual_seq_len`` (batch_size, ``documents``) int32, padded with seq_length.
    """

    files: list
    num_samples: int
    rank: int
    world_size: int
    batch_size: int
    shuffle: bool
    seed: int
    drop_remainder: bool
    num_parallel_workers: int = 1
    read_labels: bool = True
    pad_token_id: int = 0
    vocab_size: int | None = None   # ids and labels are checked against it as batches are read
    pairs: bool = False   # DPO preference pairs: batches of (B, 2, L) chosen/rejected (msllm.data.preference)
    # packed rows (msllm.data.packing): "packed" or "mindformers_packed", with batches of
    # (input_ids, labels, actual_seq_len (B, documents) int32 padded with seq_length)
    layout: str = "rows"
    documents: int = 0
    seq_length: int = 0
    # dpo.precompute_ref: (num_samples, 2) float32 reference log-probs by sample index, yielded as a
    # third batch element (B, 2) (msllm.training.dpo_values)
    ref_logps: np.ndarray | None = None

    @property
    def packed(self) -> bool:
        return self.layout != "rows"

    @property
    def samples_per_rank(self) -> int:
        return self.num_samples // self.world_size

    @property
    def steps_per_epoch(self) -> int:
        n, b = self.samples_per_rank, self.batch_size
        return n // b if self.drop_remainder else -(-n // b)

    def rank_indices(self, epoch: int) -> np.ndarray:
        """Sample indices this rank reads in ``epoch`` (0-based), in order."""
        order = epoch_order(self.num_samples, epoch, self.seed, self.shuffle)
        mine = order[self.rank::self.world_size][: self.samples_per_rank]
        return mine[: self.steps_per_epoch * self.batch_size]

    def epoch_batches(self, epoch: int, start_step: int = 0):
        """Iterator over this rank's batches of ``epoch`` (0-based) from batch ``start_step``:
        yields ``(input_ids, labels)`` MindSpore tensors."""
        import mindspore.dataset as ds

        indices = self.rank_indices(epoch)[start_step * self.batch_size:]
        if len(indices) == 0:
            return iter(())
        if self.pairs:
            from msllm.data.preference import PAIR_COLUMNS

            data = ds.MindDataset(self.files, columns_list=list(PAIR_COLUMNS), sampler=ds.SubsetSampler(indices.tolist()),
                                  num_parallel_workers=self.num_parallel_workers)
            # (L,) x 4 -> ids (2, L), labels (2, L): row 0 chosen, row 1 rejected (msllm.training.dpo)
            data = data.map(operations=lambda ci, cl, ri, rl: (np.stack([ci, ri]), np.stack([cl, rl])),
                            input_columns=list(PAIR_COLUMNS), output_columns=list(COLUMNS))
        elif self.packed:
            from msllm.data.packing import PACKED_COLUMN

            cols = list(COLUMNS) + [PACKED_COLUMN]
            data = ds.MindDataset(self.files, columns_list=cols, sampler=ds.SubsetSampler(indices.tolist()),
                                  num_parallel_workers=self.num_parallel_workers)
            data = data.map(operations=self.packed_row, input_columns=cols, output_columns=cols)
        else:
            data = ds.MindDataset(self.files, columns_list=list(COLUMNS),
                                  sampler=ds.SubsetSampler(indices.tolist()),
                                  num_parallel_workers=self.num_parallel_workers)
        if self.packed and not self.read_labels:
            raise MsllmError("train_dataset.input_columns=[\"input_ids\"] with packed data: a packed row's targets "
                             "come from its labels column; use [\"input_ids\", \"labels\"]")
        if not self.read_labels:
            pad = self.pad_token_id
            data = data.map(operations=lambda ids, _labels: (ids, labels_from_input_ids(ids, pad)),
                            input_columns=list(COLUMNS), output_columns=list(COLUMNS))
        data = data.batch(self.batch_size, drop_remainder=self.drop_remainder)
        batches = data.create_tuple_iterator(num_epochs=1)
        if self.vocab_size is not None:
            batches = (check_batch_ids(b[0], b[1], self.vocab_size, self.files, epoch, start_step + k) + tuple(b[2:])
                       for k, b in enumerate(batches))
        if self.ref_logps is None:
            return batches
        from mindspore import Tensor   # SubsetSampler keeps the order of `indices`

        bs = self.batch_size
        return (tuple(b) + (Tensor(self.ref_logps[indices[k * bs:(k + 1) * bs]]),) for k, b in enumerate(batches))

    def packed_row(self, ids, labels, ends):
        """One packed row as the model takes it: msllm's layout (MindFormers' rows converted:
        :func:`msllm.data.packing.from_mindformers_row`), ``actual_seq_len`` padded to
        ``documents`` with ``seq_length``."""
        from msllm.data.packing import check_actual_seq_len, from_mindformers_row, pad_actual_seq_len

        if self.layout == "mindformers_packed":
            ids, labels, ends = from_mindformers_row(ids, labels, ends, self.pad_token_id)
        else:
            check_actual_seq_len(ends, self.seq_length, ", ".join(self.files))
        return ids, labels, pad_actual_seq_len(ends, self.documents, self.seq_length)


def check_batch_ids(input_ids, labels, vocab_size: int, files, epoch: int, batch: int):
    """``(input_ids, labels)`` unchanged if every id is in ``[0, vocab_size)`` and every label is
    too or is ``IGNORE_INDEX``; else MsllmError naming the files, the epoch and batch, and the
    value (an embedding row or a loss target that does not exist: MindSpore's gather would read
    out of bounds and the fused loss would silently skip the target)."""
    ids, lab = input_ids.asnumpy(), labels.asnumpy()
    bad_ids = (ids < 0) | (ids >= vocab_size)
    bad_lab = ((lab < 0) | (lab >= vocab_size)) & (lab != IGNORE_INDEX)
    if bad_ids.any() or bad_lab.any():
        what, arr, mask = ("input_ids", ids, bad_ids) if bad_ids.any() else ("labels", lab, bad_lab)
        raise MsllmError(f"{', '.join(files)}: epoch {epoch + 1}, batch {batch + 1} holds {what} value "
                         f"{int(arr[mask][0])}, outside [0, {vocab_size}) (the model's vocab_size"
                         f"{'' if what == 'input_ids' else f'; or {IGNORE_INDEX}, ignored'}): the data were "
                         "tokenized for another model; preprocess them with this model's tokenizer")
    return input_ids, labels


def usable_workers() -> int:
    """The most reader threads MindDataset accepts here: the machine's CPU count (MindSpore 2.10
    raises "num_parallel_workers exceeds the boundary between 1 and N" above it)."""
    import os

    return max(1, os.cpu_count() or 1)


def count_samples(files: list, column: str = COLUMNS[0]) -> int:
    """Total samples in MindRecord ``files``."""
    import mindspore.dataset as ds

    return ds.MindDataset(files, columns_list=[column], shuffle=False).get_dataset_size()


def check_pair_dataset(dataset_dir: str, seq_length: int) -> list:
    """The preference MindRecord files of ``dataset_dir`` (:mod:`msllm.data.preference`), each checked
    for the pair columns and rows of ``seq_length + 1``. Raises MsllmError naming the file."""
    from msllm.data.mindrecord import read_mindrecord_meta, resolve_mindrecord_files
    from msllm.data.preference import is_preference_mindrecord

    files = resolve_mindrecord_files(dataset_dir)
    for f in files:
        if not is_preference_mindrecord(f):
            raise MsllmError(f"{f}: dpo needs preference pairs (columns chosen_input_ids, chosen_labels, "
                             "rejected_input_ids, rejected_labels: llama_preprocess.py --dataset_type dpo)")
        meta = read_mindrecord_meta(f) if os.path.isfile(f + ".json") else None
        if meta is not None and meta.get("seq_length") != seq_length:
            raise MsllmError(f"{f}.json: records seq_length {meta.get('seq_length')}, but the model expects "
                             f"seq_length {seq_length}; rerun llama_preprocess.py with --seq_length {seq_length}")
    return files


def build_train_data(dataset_dir: str, seq_length: int, batch_size: int, shuffle: bool,
                     drop_remainder: bool, rank: int, world_size: int, seed: int = 0,
                     num_parallel_workers: int = 1, prefetch_size: int = 4,
                     input_columns=COLUMNS, pad_token_id: int = 0, vocab_size: int | None = None,
                     pairs: bool = False) -> TrainData:
    """This rank's :class:`TrainData` over ``dataset_dir`` (a .mindrecord file, one shard of a
    ``--file_partition`` group, or a directory: :func:`msllm.data.mindrecord.resolve_mindrecord_files`).

    Args:
        batch_size: samples per step on this rank (micro batch x accumulation steps).
        input_columns: ``["input_ids", "labels"]`` or ``["input_ids"]`` (:func:`check_input_columns`).
        pad_token_id: the padding id (``model_config.pad_token_id``), for ``["input_ids"]``.
        vocab_size: the model's; every batch read is checked against it (:func:`check_batch_ids`).

    Raises:
        MsllmError: empty path, missing/invalid files, seq_length mismatch (``check_dataset``),
            bad ``input_columns``, or fewer samples than one batch per rank.
    """
    import mindspore.dataset as ds

    if not dataset_dir:
        raise MsllmError("train_dataset.dataset_dir is empty: point it at a .mindrecord file or a "
                         "directory of them (made by data_preprocess/llama_preprocess.py)")
    read_labels = check_input_columns(input_columns)
    files = check_pair_dataset(dataset_dir, seq_length) if pairs else check_dataset(dataset_dir, seq_length)
    if pairs and not read_labels:
        raise MsllmError("train_dataset.input_columns=[\"input_ids\"] with dpo: preference pairs need their labels "
                         "(the completion tokens); use [\"input_ids\", \"labels\"]")
    if prefetch_size < 1:
        raise MsllmError(f"train_dataset.prefetch_size={prefetch_size}: expected an integer >= 1")
    if num_parallel_workers < 1:
        raise MsllmError(f"train_dataset.num_parallel_workers={num_parallel_workers}: expected an integer >= 1")
    # MindDataset refuses more workers than cores (a traceback at the first epoch): clamp, named
    # at start-up by msllm.settings.check_settings
    num_parallel_workers = min(num_parallel_workers, usable_workers())
    ds.config.set_prefetch_size(prefetch_size)
    from msllm.data.preference import PAIR_COLUMNS

    layout, documents = ("rows", 0) if pairs else packed_layout(files, seq_length)
    data = TrainData(files=files, num_samples=count_samples(files, PAIR_COLUMNS[0] if pairs else COLUMNS[0]),
                     rank=rank, world_size=world_size,
                     batch_size=batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder,
                     num_parallel_workers=num_parallel_workers, read_labels=read_labels,
                     pad_token_id=pad_token_id, vocab_size=vocab_size, pairs=pairs, layout=layout,
                     documents=documents, seq_length=seq_length)
    if data.steps_per_epoch < 1:
        raise MsllmError(f"train_dataset {dataset_dir!r}: {data.num_samples} samples over {world_size} "
                         f"rank(s) give {data.samples_per_rank} per rank, fewer than one batch of "
                         f"{batch_size}; use more data or a smaller batch_size")
    return data


def packed_layout(files: list, seq_length: int) -> tuple[str, int]:
    """(layout, documents) of checked MindRecord ``files``: ``("rows", 0)`` unpacked, else
    ``"packed"`` / ``"mindformers_packed"`` (:func:`msllm.data.mindrecord.check_mindrecord`) and the
    most documents in one row plus one (so every padded ``actual_seq_len`` ends with
    ``seq_length``: the padding after the last document is a segment of its own, and the
    FlashAttentionScore TND lengths end at the row's end). One pass over the
    ``actual_seq_len`` column (MindFormers pads it to a configured ``compressed_eod_mask_length``;
    msllm sizes it from the data, so nothing is refused).

    Raises:
        MsllmError: the files mix layouts (naming them).
    """
    import mindspore.dataset as ds

    from msllm.data.mindrecord import check_mindrecord
    from msllm.data.packing import PACKED_COLUMN

    layouts = {f: check_mindrecord(f, seq_length)["layout"] for f in files}
    if len(set(layouts.values())) > 1:
        raise MsllmError(f"train data mixes row layouts {layouts} (expected all packed or all unpacked: "
                         "preprocess them with the same --pack setting)")
    layout = next(iter(layouts.values()))
    if layout == "rows":
        return layout, 0
    data = ds.MindDataset(files, columns_list=[PACKED_COLUMN], shuffle=False)
    most = max(int(row[0].shape[0]) for row in data.create_tuple_iterator(output_numpy=True, num_epochs=1))
    return layout, most + 1
