"""LlamaTokenizer on the real LLaMA tokenizer.model."""

from __future__ import annotations

import pytest
from datatest_helpers import ALPACA, TOKENIZER

from msllm.data.tokenizer import LlamaTokenizer, file_md5
from msllm.errors import MsllmError


def test_special_ids_and_vocab(tokenizer):
    assert (tokenizer.vocab_size, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (32000, 0, 1, 2)
    assert tokenizer.pad_id == 0  # LLaMA has no pad piece: documented default = unk


def test_encode_has_no_bos_eos_and_round_trips(tokenizer, alpaca_records):
    assert tokenizer.encode("Hello world") == [15043, 3186]
    for rec in alpaca_records[:200]:
        ids = tokenizer.encode(rec["output"])
        assert ids and ids[0] != tokenizer.bos_id and ids[-1] != tokenizer.eos_id
        assert tokenizer.decode(ids) == rec["output"]
    assert tokenizer.encode_batch(["Hello world", ""]) == [[15043, 3186], []]


def test_pad_id_override_and_validation():
    assert LlamaTokenizer(TOKENIZER, pad_id=2).pad_id == 2
    assert LlamaTokenizer(TOKENIZER, pad_id=None).pad_id == 0  # model has no pad piece
    with pytest.raises(MsllmError, match="outside the vocabulary"):
        LlamaTokenizer(TOKENIZER, pad_id=-1)


def test_md5_matches_documented_source():
    assert file_md5(TOKENIZER) == "eeec4125e9c7560836b4873b6f8e3025"  # examples/data/SOURCES.md


@pytest.mark.parametrize("kind", ["missing", "not_model", "directory", "empty"])
def test_bad_model_paths_name_the_path(tmp_path, kind):
    if kind == "missing":
        path = str(tmp_path / "tokenizer.model")
    elif kind == "not_model":
        path = ALPACA
    elif kind == "directory":
        path = str(tmp_path)
    else:
        path = str(tmp_path / "empty.model")
        open(path, "wb").close()
    with pytest.raises(MsllmError) as info:
        LlamaTokenizer(path)
    assert path in str(info.value)
