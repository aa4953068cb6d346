"""End-to-end preprocessing of the real data into MindRecord; reading, checking, atomicity."""

from __future__ import annotations

import filecmp
import json
import os
import shutil

import numpy as np
import pytest
from datatest_helpers import ALPACA, TOKENIZER, WIKI

from msllm.data.conversation import alpaca_to_conversation
from msllm.data.mindrecord import (
    SIDECAR_KEYS,
    check_dataset,
    check_mindrecord,
    read_mindrecord_arrays,
    read_mindrecord_meta,
    resolve_mindrecord_files,
    write_mindrecord,
)
from msllm.data.preprocess import IGNORE_INDEX, build_qa_sample, preprocess_to_mindrecord
from msllm.errors import MsllmError

SEQ = 256


@pytest.fixture(scope="session")
def alpaca_runs(tmp_path_factory, conversation_file):
    """Full Alpaca at seq_length 256 (shuffle=1, seed 0) with 1 and with 2 workers, written under
    the same basename in two directories (the header records the basename)."""
    out = {}
    for workers in (1, 2):
        path = str(tmp_path_factory.mktemp(f"w{workers}") / "alpaca.mindrecord")
        summary = preprocess_to_mindrecord(
            conversation_file, "qa", TOKENIZER, SEQ, path, repeat=1, shuffle=True, seed=0,
            num_workers=workers, progress=False, template="alpaca",
        )
        out[workers] = (path, summary)
    return out


def test_workers_1_and_2_are_byte_identical(alpaca_runs):
    (p1, s1), (p2, s2) = alpaca_runs[1], alpaca_runs[2]
    for suffix in ("", ".db", ".json"):
        assert filecmp.cmp(p1 + suffix, p2 + suffix, shallow=False), suffix
    a1, a2 = read_mindrecord_arrays(p1), read_mindrecord_arrays(p2)
    for k in ("input_ids", "labels"):
        assert np.array_equal(a1[k], a2[k])
    assert s1.counts() == s2.counts()
    with open(p1 + ".json") as f1, open(p2 + ".json") as f2:
        assert json.load(f1) == json.load(f2)


def test_alpaca_summary_and_sidecar(alpaca_runs, tokenizer, alpaca_records):
    path, summary = alpaca_runs[1]
    # truncation count, computed independently from the full-length samples
    convs = alpaca_to_conversation(alpaca_records, ALPACA)
    full = [build_qa_sample(tokenizer, [(t["from"], t["value"]) for t in c["conversations"]], 100000, "alpaca") for c in convs]
    expected_trunc = sum(1 for r in full if r.input_ids.shape[0] > SEQ + 1)
    assert summary.records_read == summary.samples_built == summary.samples_written == 999
    assert summary.truncated == expected_trunc > 0
    assert summary.skipped == {}
    meta = json.load(open(path + ".json"))
    assert tuple(meta) == SIDECAR_KEYS
    assert meta["seq_length"] == SEQ and meta["sample_length"] == SEQ + 1
    assert meta["dataset_type"] == "qa" and meta["pad_token_id"] == 0 and meta["ignore_index"] == -100
    assert meta["tokenizer_md5"] == "eeec4125e9c7560836b4873b6f8e3025"
    assert meta["num_samples"] == 999 and meta["counts"]["truncated"] == expected_trunc
    arrays = read_mindrecord_arrays(path)
    ids, labels = arrays["input_ids"], arrays["labels"]
    assert ids.shape == labels.shape == (999, SEQ + 1) and ids.dtype == labels.dtype == np.int32
    assert meta["counts"]["loss_tokens"] == int((labels[:, 1:] != IGNORE_INDEX).sum())
    assert meta["counts"]["tokens_written"] == summary.tokens_written
    # padding: after the last real token input_ids == pad (0) and labels == -100
    real = sorted(min(SEQ + 1, r.input_ids.shape[0]) for r in full)
    ends = []
    for row_ids, row_labels in zip(ids, labels):
        n = int(np.flatnonzero(row_ids != 0)[-1]) + 1
        assert (row_labels[n:] == IGNORE_INDEX).all()
        assert row_ids[n - 1] == tokenizer.eos_id or n == SEQ + 1
        ends.append(n)
    assert sorted(ends) == real
    assert sum(real) == summary.tokens_written


def test_unshuffled_rows_follow_records_and_repeat(tmp_path, conversation_file, tokenizer, alpaca_records):
    small = tmp_path / "small.json"
    small.write_text(json.dumps(json.load(open(conversation_file))[:30]))
    plain = str(tmp_path / "plain" / "s.mindrecord")
    shuf = str(tmp_path / "shuf" / "s.mindrecord")
    preprocess_to_mindrecord(str(small), "qa", TOKENIZER, 512, plain, repeat=2, shuffle=False, progress=False,
                             template="alpaca")
    preprocess_to_mindrecord(str(small), "qa", TOKENIZER, 512, shuf, repeat=2, shuffle=True, seed=3, progress=False,
                             template="alpaca")
    a = read_mindrecord_arrays(plain)
    assert a["input_ids"].shape == (60, 513)
    assert np.array_equal(a["input_ids"][:30], a["input_ids"][30:])  # repeat = list repeated
    for i in range(30):
        keep = a["labels"][i] != IGNORE_INDEX
        out = alpaca_records[i]["output"]
        expected = (tokenizer.encode(out) + [tokenizer.eos_id])[: int(keep.sum())]
        assert a["input_ids"][i][keep].tolist() == expected
        pad = a["labels"][i] == IGNORE_INDEX
        assert (a["input_ids"][i][int(np.flatnonzero(keep)[-1]) + 1:] == 0).all()
        assert pad[0]
    b = read_mindrecord_arrays(shuf)
    assert not np.array_equal(a["input_ids"], b["input_ids"])
    # the shuffled file holds the same rows (a permutation)
    key = lambda m: sorted(map(bytes, m))  # noqa: E731
    assert key(a["input_ids"]) == key(b["input_ids"]) and key(a["labels"]) == key(b["labels"])


def test_minddataset_reads_int32_rows(alpaca_runs):
    import mindspore.dataset as ds

    path, _ = alpaca_runs[1]
    dataset = ds.MindDataset(path, columns_list=["input_ids", "labels"], shuffle=False)
    assert dataset.get_dataset_size() == 999
    n = 0
    for row in dataset.create_dict_iterator(output_numpy=True, num_epochs=1):
        assert row["input_ids"].dtype == np.int32 and row["labels"].dtype == np.int32
        assert row["input_ids"].shape == row["labels"].shape == (SEQ + 1,)
        n += 1
    assert n == 999


def test_wiki_end_to_end(tmp_path, tokenizer):
    path = str(tmp_path / "wiki.mindrecord")
    s = preprocess_to_mindrecord(WIKI, "wiki", TOKENIZER, 1024, path, shuffle=False, progress=False)
    a = read_mindrecord_arrays(path)
    assert np.array_equal(a["input_ids"], a["labels"])  # no masking
    assert a["input_ids"].shape == (s.samples_written, 1025)
    assert s.records_read == 30 and s.truncated == 0
    assert s.samples_written * 1025 + s.dropped_tail_tokens == 30 * 2 + sum(
        len(tokenizer.encode(line)) for line in open(WIKI, encoding="utf-8").read().splitlines() if line.strip()
    )
    assert a["input_ids"][0, 0] == tokenizer.bos_id
    assert s.loss_tokens == s.samples_written * 1024
    assert check_mindrecord(path, 1024)["dataset_type"] == "wiki"


def test_check_mindrecord_ok_and_wrong_seq_length(alpaca_runs):
    path, _ = alpaca_runs[1]
    meta = check_mindrecord(path, SEQ)
    assert meta["meta_source"] == "sidecar" and meta["num_samples"] == 999
    with pytest.raises(MsllmError) as info:
        check_mindrecord(path, 512)
    msg = str(info.value)
    assert path in msg and "257" in msg and "513" in msg and "512" in msg


def test_check_mindrecord_missing_db(tmp_path, alpaca_runs):
    path, _ = alpaca_runs[1]
    lone = tmp_path / "alpaca.mindrecord"
    shutil.copy(path, lone)
    with pytest.raises(MsllmError, match=r"alpaca\.mindrecord\.db is missing"):
        check_mindrecord(str(lone), SEQ)


def test_check_mindrecord_not_a_mindrecord(tmp_path):
    fake = tmp_path / "fake.mindrecord"
    fake.write_text("hello, not a mindrecord")
    with pytest.raises(MsllmError, match="not a MindRecord"):
        check_mindrecord(str(fake), SEQ)
    with pytest.raises(MsllmError, match="not found"):
        check_mindrecord(str(tmp_path / "absent.mindrecord"), SEQ)


def test_renamed_mindrecord_is_unreadable_and_detected(tmp_path, alpaca_runs):
    """The finding behind the temp-directory atomic write: MindSpore opens the shard named in
    the header, so a renamed file breaks, a moved one (same basename) does not."""
    import mindspore.dataset as ds

    path, _ = alpaca_runs[1]
    renamed = tmp_path / "renamed.mindrecord"
    shutil.copy(path, renamed)
    shutil.copy(path + ".db", str(renamed) + ".db")
    with pytest.raises(RuntimeError, match="can not be found"):
        ds.MindDataset(str(renamed), shuffle=False).get_dataset_size()
    with pytest.raises(MsllmError, match="renamed"):
        check_mindrecord(str(renamed), SEQ)
    moved = tmp_path / "moved" / "alpaca.mindrecord"
    moved.parent.mkdir()
    shutil.copy(path, moved)
    shutil.copy(path + ".db", str(moved) + ".db")
    assert ds.MindDataset(str(moved), shuffle=False).get_dataset_size() == 999


def test_meta_fallback_without_sidecar(tmp_path, alpaca_runs):
    path, _ = alpaca_runs[1]
    d = tmp_path / "nosidecar"
    d.mkdir()
    shutil.copy(path, d / "alpaca.mindrecord")
    shutil.copy(path + ".db", d / "alpaca.mindrecord.db")
    meta = read_mindrecord_meta(str(d / "alpaca.mindrecord"))
    assert meta == {"seq_length": SEQ, "sample_length": SEQ + 1, "num_samples": 999, "meta_source": "first_sample"}
    with pytest.raises(MsllmError, match="seq_length 128"):
        check_mindrecord(str(d / "alpaca.mindrecord"), 128)


def test_sidecar_mismatch_detected(tmp_path, alpaca_runs):
    path, _ = alpaca_runs[1]
    d = tmp_path / "stale"
    d.mkdir()
    for suffix in ("", ".db", ".json"):
        shutil.copy(path + suffix, d / ("alpaca.mindrecord" + suffix))
    meta = json.load(open(path + ".json"))
    meta["num_samples"] = 5
    (d / "alpaca.mindrecord.json").write_text(json.dumps(meta))
    with pytest.raises(MsllmError, match="records 5 samples but"):
        check_mindrecord(str(d / "alpaca.mindrecord"), SEQ)


def test_resolve_dataset_paths(tmp_path, alpaca_runs):
    path, _ = alpaca_runs[1]
    d = tmp_path / "ds"
    d.mkdir()
    for name in ("b.mindrecord", "a.mindrecord"):
        shutil.copy(path, d / name)
        shutil.copy(path + ".db", d / (name + ".db"))
        shutil.copy(path + ".json", d / (name + ".json"))
    (d / "notes.txt").write_text("x")
    assert resolve_mindrecord_files(str(d)) == [str(d / "a.mindrecord"), str(d / "b.mindrecord")]
    assert resolve_mindrecord_files(path) == [path]
    with pytest.raises(MsllmError, match="pass the data file"):
        resolve_mindrecord_files(path + ".db")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MsllmError, match="no \\*.mindrecord files"):
        resolve_mindrecord_files(str(empty))
    with pytest.raises(MsllmError, match="not found"):
        resolve_mindrecord_files(str(tmp_path / "nothing"))
    # copies were renamed (a/b), so the full check refuses them; the original passes
    with pytest.raises(MsllmError, match="renamed"):
        check_dataset(str(d), SEQ)
    assert check_dataset(os.path.dirname(path), SEQ) == [path]


def _rows(n, length, fail_at=None):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("boom")
        yield np.full(length, i, np.int32), np.full(length, i, np.int32)


def test_write_is_atomic_on_failure(tmp_path):
    out = tmp_path / "out" / "x.mindrecord"
    with pytest.raises(RuntimeError, match="boom"):
        write_mindrecord(str(out), _rows(3000, 9, fail_at=2500), meta={"seq_length": 8})
    assert os.listdir(out.parent) == []  # no final files, no temp dir
    # a previous good output survives a failed rewrite untouched
    assert write_mindrecord(str(out), _rows(10, 9), meta={"seq_length": 8}) == 10
    before = {s: (out.parent / ("x.mindrecord" + s)).read_bytes() for s in ("", ".db", ".json")}
    with pytest.raises(RuntimeError, match="boom"):
        write_mindrecord(str(out), _rows(3000, 9, fail_at=2000), meta={"seq_length": 8})
    assert sorted(os.listdir(out.parent)) == ["x.mindrecord", "x.mindrecord.db", "x.mindrecord.json"]
    for s, data in before.items():
        assert (out.parent / ("x.mindrecord" + s)).read_bytes() == data
    assert read_mindrecord_arrays(str(out))["input_ids"][:, 0].tolist() == list(range(10))
    with pytest.raises(MsllmError, match="no samples"):
        write_mindrecord(str(tmp_path / "empty.mindrecord"), iter(()))
    assert not any(n.startswith("empty") or n.startswith(".empty") for n in os.listdir(tmp_path))
