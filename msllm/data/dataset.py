"""The training input pipeline: MindRecord files -> sharded, shuffled, batched MindDataset.

Each data-parallel rank reads a disjoint shard (``MindDataset(num_shards=world, shard_id=rank)``,
MindSpore doc "mindspore.dataset.MindDataset"), so the global batch per step is
``batch_size x gradient_accumulation_steps x data_parallel`` samples.
"""

from __future__ import annotations

from dataclasses import dataclass

from msllm.data.mindrecord import COLUMNS, check_dataset
from msllm.errors import MsllmError


@dataclass
class TrainData:
    """A batched dataset and its size: ``steps_per_epoch`` batches of
    ``input_ids`` and ``labels``, each (batch, seq_length + 1) int32, per rank and epoch."""

    dataset: object
    files: list
    steps_per_epoch: int
    batch_size: int


def build_train_data(dataset_dir: str, seq_length: int, batch_size: int, shuffle: bool,
                     drop_remainder: bool, rank: int, world_size: int, num_parallel_workers: int = 1,
                     prefetch_size: int = 4) -> TrainData:
    """MindDataset over ``dataset_dir`` for rank ``rank`` of ``world_size``.

    Args:
        batch_size: samples per batch on this rank (micro batch x accumulation steps).
        shuffle: global shuffle of samples each epoch (seeded by ``mindspore.dataset.config``).

    Raises:
        MsllmError: missing/invalid files, seq_length mismatch (see ``check_dataset``), or fewer
            samples than one batch per rank.
    """
    import mindspore.dataset as ds

    if not dataset_dir:
        raise MsllmError("train_dataset.dataset_dir is empty: point it at a .mindrecord file or a "
                         "directory of them (made by data_preprocess/llama_preprocess.py)")
    files = check_dataset(dataset_dir, seq_length)
    ds.config.set_prefetch_size(prefetch_size)
    shard = dict(num_shards=world_size, shard_id=rank) if world_size > 1 else {}
    data = ds.MindDataset(files, columns_list=list(COLUMNS), shuffle=shuffle,
                          num_parallel_workers=num_parallel_workers, **shard)
    samples = data.get_dataset_size()
    if samples < batch_size:
        raise MsllmError(f"train_dataset {dataset_dir!r}: rank {rank} gets {samples} samples, fewer "
                         f"than one batch of {batch_size}; use more data or a smaller batch_size")
    data = data.batch(batch_size, drop_remainder=drop_remainder)
    return TrainData(dataset=data, files=files, steps_per_epoch=data.get_dataset_size(), batch_size=batch_size)
