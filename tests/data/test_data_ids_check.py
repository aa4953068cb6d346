"""Token ids outside the model's vocabulary are one clear error when the batch is read (both model
paths then never see them: the fused loss would skip such a target while still counting it, the
composed loss would read out of bounds), and the data-tokenizer check refuses them at start."""

import numpy as np
import pytest

from msllm.data.dataset import build_train_data, check_batch_ids
from msllm.errors import MsllmError
from msllm.training.sources import check_data_tokenizer


def test_batches_with_ids_beyond_the_vocabulary_are_refused_as_read(alpaca_mindrecord):
    data = build_train_data(alpaca_mindrecord, 64, 4, False, True, 0, 1, vocab_size=1000)
    with pytest.raises(MsllmError, match=r"epoch 1, batch 1 holds input_ids value \d+, outside \[0, 1000\)"):
        next(iter(data.epoch_batches(0)))
    ok = build_train_data(alpaca_mindrecord, 64, 4, False, True, 0, 1, vocab_size=32000)
    ids, labels = next(iter(ok.epoch_batches(0)))
    assert ids.shape == labels.shape


def test_labels_check_allows_the_ignore_index_only():
    import mindspore as ms

    ids = ms.Tensor(np.array([[1, 5, 7]], np.int32))
    check_batch_ids(ids, ms.Tensor(np.array([[-100, 5, 7]], np.int32)), 8, ["f"], 0, 0)
    with pytest.raises(MsllmError, match=r"labels value 8, outside \[0, 8\).*or -100, ignored"):
        check_batch_ids(ids, ms.Tensor(np.array([[-100, 5, 8]], np.int32)), 8, ["f"], 0, 2)
    with pytest.raises(MsllmError, match="labels value -5"):
        check_batch_ids(ids, ms.Tensor(np.array([[-5, 5, 7]], np.int32)), 8, ["f"], 0, 2)


def test_sidecar_vocabulary_larger_than_the_model_is_refused_at_start(alpaca_mindrecord):
    from msllm.config import load_config
    from msllm.data.mindrecord import read_mindrecord_meta
    from helpers import TINY_YAML

    cfg = load_config(TINY_YAML, ["--model.model_config.vocab_size=1000"])
    with pytest.raises(MsllmError, match="was tokenized with a 32000-id tokenizer .* vocab_size 1000"):
        check_data_tokenizer(cfg, read_mindrecord_meta(alpaca_mindrecord), alpaca_mindrecord)
