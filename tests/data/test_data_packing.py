"""``llama_preprocess.py --dataset_type qa --pack`` and the readers of packed MindRecords.

* :func:`pack_samples` on a hand-checked example (greedy, in order, whole documents, rows of
  seq_length + 1, MindFormers' ``actual_seq_len``, each document's first label ignored);
* the bundled real Alpaca data preprocessed with and without ``--pack`` (same order): unpacking the
  packed rows gives exactly the unpacked file's samples, and the counts agree;
* a MindRecord written the way MindFormers' ``PackingHandler`` (``pack_examples``,
  mindformers/dataset/handler/packing_handler.py) writes one: rows of seq_length, labels shifted
  with ``pad_token`` after each document, ``actual_seq_len`` of variable length. The training
  reader turns it into msllm's packed batches, and evaluation's perplexity of it and of msllm's
  packed file equal the unpacked file's (a small random model).
"""

from __future__ import annotations

import numpy as np
import pytest

from datatest_helpers import ALPACA, TOKENIZER

from msllm.data.packing import pack_samples, unpack_row
from msllm.data.templates import IGNORE_INDEX as IG

SEED = 20261127
SEQ = 512    # the demo data average ~200 tokens: 2-3 conversations per row
DOCS = 40


def test_pack_samples_hand_checked():
    a = (np.array([1, 2, 3]), np.array([IG, 12, 13]))
    b = (np.array([4, 5, 6, 7]), np.array([14, IG, 16, 17]))    # a first label that is set: ignored when packed
    c = (np.array([8, 9, 10, 11, 12]), np.array([IG, IG, 20, 21, 22]))
    d = (np.array([30] * 8), np.array([31] * 8))                 # exactly seq_length + 1: a row alone
    rows = pack_samples([a, b, c, d], 7, 0)
    assert len(rows) == 3
    (i0, l0, e0), (i1, l1, e1), (i2, l2, e2) = rows
    assert i0.tolist() == [1, 2, 3, 4, 5, 6, 7, 0] and e0.tolist() == [3, 7]
    assert l0.tolist() == [IG, 12, 13, IG, IG, 16, 17, IG]
    assert i1.tolist() == [8, 9, 10, 11, 12, 0, 0, 0] and e1.tolist() == [5]
    assert l1.tolist() == [IG, IG, 20, 21, 22, IG, IG, IG]
    assert i2.tolist() == [30] * 8 and e2.tolist() == [7] and l2.tolist() == [IG] + [31] * 7
    docs = unpack_row(i0, l0, e0, 0) + unpack_row(i1, l1, e1, 0) + unpack_row(i2, l2, e2, 0)
    for (x, y), (px, py) in zip([a, b, c, d], docs):
        assert px.tolist() == x.tolist() and py[1:].tolist() == y[1:].tolist() and py[0] == IG


def test_pack_refuses_wiki(tmp_path):
    from msllm.data.preprocess import preprocess_to_mindrecord
    from msllm.errors import MsllmError

    with pytest.raises(MsllmError, match="--pack applies to --dataset_type qa only"):
        preprocess_to_mindrecord(ALPACA, "wiki", TOKENIZER, 64, str(tmp_path / "x.mindrecord"), pack=True)


@pytest.fixture(scope="module")
def alpaca_pair(tmp_path_factory):
    """The first DOCS bundled Alpaca records at seq_length SEQ, unpacked and packed (same order)."""
    from msllm.data.conversation import convert_alpaca_file
    from msllm.data.preprocess import preprocess_to_mindrecord

    d = tmp_path_factory.mktemp("pack")
    conv = str(d / "conv.json")
    convert_alpaca_file(ALPACA, conv)
    kw = dict(shuffle=False, progress=False, samples_num=DOCS)
    plain = preprocess_to_mindrecord(conv, "qa", TOKENIZER, SEQ, str(d / "plain.mindrecord"), **kw)
    packed = preprocess_to_mindrecord(conv, "qa", TOKENIZER, SEQ, str(d / "packed.mindrecord"), pack=True, **kw)
    return d, plain, packed


def read_all(path):
    from mindspore.mindrecord import FileReader

    r = FileReader(path, num_consumer=1)
    rows = list(r.get_next())
    r.close()
    return rows


def test_packed_file_holds_the_unpacked_samples(alpaca_pair):
    from msllm.data.mindrecord import read_mindrecord_arrays, read_mindrecord_meta

    d, plain, packed = alpaca_pair
    print(plain.format())
    print(packed.format())
    assert packed.tokens_written == plain.tokens_written and packed.loss_tokens == plain.loss_tokens
    assert packed.samples_written < plain.samples_written
    meta = read_mindrecord_meta(str(d / "packed.mindrecord"))
    assert meta["columns"] == {"input_ids": "int32", "labels": "int32", "actual_seq_len": "int32"}
    assert meta["packing"]["documents"] == plain.samples_written == DOCS
    ref = read_mindrecord_arrays(str(d / "plain.mindrecord"))
    docs = []
    for row in read_all(str(d / "packed.mindrecord")):
        assert row["input_ids"].shape == (SEQ + 1,)
        docs += unpack_row(row["input_ids"], row["labels"], row["actual_seq_len"], 0)
    assert len(docs) == DOCS
    for k, (ids, lab) in enumerate(docs):
        n = len(ids)
        assert ref["input_ids"][k, :n].tolist() == ids.tolist() and (ref["input_ids"][k, n:] == 0).all()
        assert ref["labels"][k, 1:n].tolist() == lab[1:].tolist() and (ref["labels"][k, n:] == IG).all()


def mindformers_packed_rows(samples, seq_length, pad_token):
    """Rows as MindFormers' ``pack_examples`` builds them (from its statement: each sample's
    input_ids appended whole, its labels[1:] plus pad_token, cumulative ends; a row closed when the
    next sample does not fit seq_length; input_ids padded with pad_token, labels with -100)."""
    rows, cur = [], {"input_ids": [], "labels": [], "actual_seq_len": [0]}
    for ids, lab in samples:
        if len(ids) > seq_length:
            continue
        if len(cur["input_ids"]) + len(ids) > seq_length:
            rows.append(cur)
            cur = {"input_ids": [], "labels": [], "actual_seq_len": [0]}
        cur["actual_seq_len"].append(cur["actual_seq_len"][-1] + len(ids))
        cur["labels"] += list(lab[1:]) + [pad_token]
        cur["input_ids"] += list(ids)
    rows.append(cur)
    out = []
    for r in rows:
        n = len(r["input_ids"])
        out.append((np.array(r["input_ids"] + [pad_token] * (seq_length - n), np.int32),
                    np.array(r["labels"] + [IG] * (seq_length - n), np.int32),
                    np.array(r["actual_seq_len"][1:], np.int32)))
    return out


@pytest.fixture(scope="module")
def mindformers_file(alpaca_pair):
    from msllm.data.mindrecord import read_mindrecord_arrays, write_mindrecord

    d, _, _ = alpaca_pair
    ref = read_mindrecord_arrays(str(d / "plain.mindrecord"))
    samples, kept = [], []
    for k, (ids, lab) in enumerate(zip(ref["input_ids"], ref["labels"])):
        n = int(np.max(np.nonzero(ids)[0])) + 1
        samples.append((ids[:n], lab[:n]))
        kept += [k] if n <= SEQ else []    # MindFormers skips samples longer than its rows
    rows = mindformers_packed_rows(samples, SEQ, 0)
    path = str(d / "mf_packed.mindrecord")
    schema = {k: {"type": "int32", "shape": [-1]} for k in ("input_ids", "labels", "actual_seq_len")}
    write_mindrecord(path, rows, meta=None, schema=schema)
    return path, rows, kept


def test_mindformers_packed_mindrecord_trains_as_msllm_packed(alpaca_pair, mindformers_file):
    """MindFormers' file through the training reader: every batch row is msllm's packed row of the
    same documents (labels: each document's last token's pad target ignored), ends padded with T."""
    from msllm.data.dataset import build_train_data

    d, _, _ = alpaca_pair
    path, mf_rows, _ = mindformers_file
    data = build_train_data(path, SEQ, 2, shuffle=False, drop_remainder=True, rank=0, world_size=1)
    assert data.layout == "mindformers_packed" and data.documents == max(len(r[2]) for r in mf_rows) + 1
    k = 0
    for ids, lab, ends in data.epoch_batches(0):
        ids, lab, ends = ids.asnumpy(), lab.asnumpy(), ends.asnumpy()
        assert ids.shape == (2, SEQ + 1) and ends.shape == (2, data.documents)
        for b in range(2):
            mf_ids, mf_lab, mf_ends = mf_rows[k]
            assert ids[b, :SEQ].tolist() == mf_ids.tolist() and ids[b, SEQ] == 0
            n = len(mf_ends)
            assert ends[b, :n].tolist() == mf_ends.tolist() and (ends[b, n:] == SEQ).all()
            want = np.concatenate([[IG], mf_lab]).astype(np.int64)
            want[mf_ends] = IG                         # the pad target at each document's last token
            assert lab[b].tolist() == want.tolist()
            k += 1
    assert k == 2 * (len(mf_rows) // 2)


def test_packed_perplexity_equals_unpacked(alpaca_pair, mindformers_file):
    import mindspore as ms

    from msllm.eval.perplexity import evaluate_loss, read_eval_records
    from msllm.models.llama.config import LlamaConfig
    from msllm.models.llama.model import LlamaForCausalLM

    d, _, _ = alpaca_pair
    plain = read_eval_records(str(d / "plain.mindrecord"), SEQ)
    ms.set_seed(SEED)
    print("seed", SEED)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=32, num_layers=1, num_heads=2, n_kv_heads=1,
                                       intermediate_size=48, seq_length=SEQ), fast_paths=True)
    net.set_train(False)
    kept = mindformers_file[2]
    for path, rows in ((str(d / "packed.mindrecord"), slice(None)), (mindformers_file[0], kept)):
        want = evaluate_loss(net, (plain[0][rows], plain[1][rows]), batch_size=16)
        got = evaluate_loss(net, read_eval_records(path, SEQ), batch_size=16)
        print(path, got, want)
        assert got[2] == want[2] and abs(got[0] - want[0]) <= 1e-6 * abs(want[0])
