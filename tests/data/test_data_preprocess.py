"""Sample building (label masking, multi-turn, truncation), wiki packing, repeat/shuffle.

The qa tests here pin the ``alpaca`` template (``[bos] + human`` masked, ``gpt + [eos]`` kept, per
pair), msllm's layout before templates; the default ``vicuna_v1.1`` (MindFormers' samples) is
tested in test_data_templates.py and test_data_mindformers.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datatest_helpers import ALPACA, WIKI

from msllm.data.conversation import SKIP_EMPTY, SKIP_NO_REPLY, SKIP_NOT_ALTERNATING, alpaca_to_conversation
from msllm.data.preprocess import (
    IGNORE_INDEX,
    SKIP_NO_RESPONSE,
    BlockPacker,
    build_qa_sample,
    expand_input_glob,
    pack_documents,
    pad_sample,
    read_wiki_documents,
    sample_order,
)
from msllm.errors import MsllmError


def _turns(conv_record):
    return [(t["from"], t["value"]) for t in conv_record["conversations"]]


def test_ignore_index_value():
    assert IGNORE_INDEX == -100


def test_unmasked_tokens_are_exactly_the_response_plus_eos(tokenizer, alpaca_records):
    """All 999 real records, no truncation: loss tokens == encode(output) + [eos]."""
    convs = alpaca_to_conversation(alpaca_records, ALPACA)
    for rec, conv in zip(alpaca_records, convs):
        res = build_qa_sample(tokenizer, _turns(conv), seq_length=4096, template="alpaca")
        assert res.skip_reason is None and not res.truncated
        ids, labels = res.input_ids, res.labels
        assert ids.dtype == np.int32 and labels.dtype == np.int32 and ids.shape == labels.shape
        keep = labels != IGNORE_INDEX
        expected = tokenizer.encode(rec["output"]) + [tokenizer.eos_id]
        assert labels[keep].tolist() == expected
        assert ids[keep].tolist() == expected  # labels equal the ids at unmasked positions
        assert tokenizer.decode(ids[keep][:-1]) == rec["output"]
        # masked part is [bos] + the prompt, and it comes first
        prompt = [tokenizer.bos_id] + tokenizer.encode(conv["conversations"][0]["value"])
        assert ids[: len(prompt)].tolist() == prompt
        assert not keep[: len(prompt)].any() and keep[len(prompt):].all()


def test_multi_turn_keeps_all_turns(tokenizer, alpaca_records):
    a, b = alpaca_records[0], alpaca_records[1]
    turns = [("human", a["instruction"]), ("gpt", a["output"]), ("human", b["instruction"]), ("gpt", b["output"])]
    res = build_qa_sample(tokenizer, turns, seq_length=4096, template="alpaca")
    enc = tokenizer.encode
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    h1, g1, h2, g2 = [bos] + enc(a["instruction"]), enc(a["output"]) + [eos], [bos] + enc(b["instruction"]), enc(b["output"]) + [eos]
    assert res.input_ids.tolist() == h1 + g1 + h2 + g2
    assert res.labels.tolist() == [IGNORE_INDEX] * len(h1) + g1 + [IGNORE_INDEX] * len(h2) + g2
    assert int((res.input_ids == bos).sum()) == 2 and int((res.input_ids == eos).sum()) == 2


def test_truncation_is_counted_and_cut_to_seq_length_plus_one(tokenizer, alpaca_records):
    seq = 256
    convs = alpaca_to_conversation(alpaca_records, ALPACA)
    n_trunc = 0
    for conv in convs:
        full = build_qa_sample(tokenizer, _turns(conv), seq_length=100000, template="alpaca")
        res = build_qa_sample(tokenizer, _turns(conv), seq_length=seq, template="alpaca")
        long = full.input_ids.shape[0] > seq + 1
        assert res.truncated == long
        if long:
            n_trunc += 1
            assert res.input_ids.shape[0] == seq + 1
            assert res.input_ids.tolist() == full.input_ids[: seq + 1].tolist()
            assert res.labels.tolist() == full.labels[: seq + 1].tolist()
        else:
            assert res.input_ids.tolist() == full.input_ids.tolist()
    assert 0 < n_trunc < len(convs)


def test_no_response_within_seq_length_is_skipped(tokenizer, alpaca_records):
    conv = alpaca_to_conversation(alpaca_records[:1], ALPACA)[0]
    n_prompt = 1 + len(tokenizer.encode(conv["conversations"][0]["value"]))
    # a window that ends exactly at the prompt: nothing to learn
    res = build_qa_sample(tokenizer, _turns(conv), seq_length=n_prompt - 1, template="alpaca")
    assert res.skip_reason == SKIP_NO_RESPONSE and res.input_ids is None
    # one more token: the first response token is in, the sample is kept (truncated)
    res = build_qa_sample(tokenizer, _turns(conv), seq_length=n_prompt, template="alpaca")
    assert res.skip_reason is None and res.truncated
    assert int((res.labels != IGNORE_INDEX).sum()) == 1


def test_content_oddities_are_skips_not_errors(tokenizer):
    assert build_qa_sample(tokenizer, [], 64).skip_reason == SKIP_EMPTY
    # One leading non-human turn is dropped, as MindFormers' preprocess does ("Skip the first one
    # if it is not from human"); before that rule this conversation was SKIP_NOT_ALTERNATING.
    assert build_qa_sample(tokenizer, [("gpt", "x"), ("human", "y")], 64).skip_reason == SKIP_NO_REPLY
    assert build_qa_sample(tokenizer, [("gpt", "x"), ("gpt", "y")], 64).skip_reason == SKIP_NOT_ALTERNATING
    dropped = build_qa_sample(tokenizer, [("gpt", "x"), ("human", "y"), ("gpt", "z")], 64)
    assert dropped.input_ids.tolist() == build_qa_sample(tokenizer, [("human", "y"), ("gpt", "z")], 64).input_ids.tolist()


def test_pad_sample():
    ids, lab = pad_sample(np.array([1, 5, 6], np.int32), np.array([-100, 5, 6], np.int32), 5, pad_token_id=0)
    assert ids.tolist() == [1, 5, 6, 0, 0, 0] and lab.tolist() == [-100, 5, 6, -100, -100, -100]
    assert ids.dtype == lab.dtype == np.int32
    with pytest.raises(ValueError):
        pad_sample(np.zeros(7, np.int32), np.zeros(7, np.int32), 5, 0)


def test_wiki_packing_on_real_text(tokenizer):
    docs = read_wiki_documents(WIKI)
    assert len(docs) == 30
    tok_docs = [tokenizer.encode(d) for d in docs]
    seq = 512
    blocks, dropped = pack_documents(tok_docs, seq, tokenizer.bos_id, tokenizer.eos_id)
    stream = [t for d in tok_docs for t in [tokenizer.bos_id] + d + [tokenizer.eos_id]]
    assert blocks.dtype == np.int32 and blocks.shape == (len(stream) // (seq + 1), seq + 1)
    assert blocks.size + dropped == len(stream)  # conserved up to the dropped tail
    assert 0 <= dropped < seq + 1
    assert blocks.reshape(-1).tolist() == stream[: blocks.size]
    assert blocks[0, 0] == tokenizer.bos_id
    # every document boundary is an EOS immediately followed by a BOS
    flat = blocks.reshape(-1)
    eos_pos = np.flatnonzero(flat == tokenizer.eos_id)
    assert len(eos_pos) >= 20
    for p in eos_pos[eos_pos + 1 < flat.size]:
        assert flat[p + 1] == tokenizer.bos_id


def test_block_packer_small():
    p = BlockPacker(4, bos_id=1, eos_id=2)
    assert [b.tolist() for b in p.add([7, 8, 9])] == [[1, 7, 8, 9]]
    assert p.pending == 1
    assert [b.tolist() for b in p.add([5, 6, 4, 3, 3])] == [[2, 1, 5, 6], [4, 3, 3, 2]]
    assert p.pending == 0 and p.stream_tokens == 12


def test_read_wiki_variants_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\n\n   \nsecond doc\n", encoding="utf-8")
    assert read_wiki_documents(str(tmp_path / "a.txt")) == ["first doc", "second doc"]
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n\n{"text": "y", "id": 3}\n', encoding="utf-8")
    assert read_wiki_documents(str(tmp_path / "b.jsonl")) == ["x", "y"]
    (tmp_path / "c.json").write_text(json.dumps([{"text": "p"}, {"text": ""}, {"text": "q"}]), encoding="utf-8")
    assert read_wiki_documents(str(tmp_path / "c.json")) == ["p", "q"]
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n{"txt": "y"}\n', encoding="utf-8")
    with pytest.raises(MsllmError, match=r"d\.jsonl: line 2 has no 'text' key"):
        read_wiki_documents(str(tmp_path / "d.jsonl"))
    (tmp_path / "e.jsonl").write_text('{"text": "x"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(MsllmError, match=r"e\.jsonl: invalid JSON at line 2"):
        read_wiki_documents(str(tmp_path / "e.jsonl"))
    (tmp_path / "f.json").write_text(json.dumps([{"text": 5}]), encoding="utf-8")
    with pytest.raises(MsllmError, match=r"f\.json: record 0 key 'text' is a JSON int"):
        read_wiki_documents(str(tmp_path / "f.json"))


def test_expand_input_glob(tmp_path):
    for n in ("b.json", "a.json", "c.txt"):
        (tmp_path / n).write_text("[]")
    assert expand_input_glob(str(tmp_path / "*.json")) == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    with pytest.raises(MsllmError, match="matches no files"):
        expand_input_glob(str(tmp_path / "*.parquet"))


def test_repeat_and_shuffle_order():
    assert sample_order(3, 2, shuffle=False, seed=0).tolist() == [0, 1, 2, 0, 1, 2]
    a = sample_order(50, 3, shuffle=True, seed=0)
    b = sample_order(50, 3, shuffle=True, seed=0)
    c = sample_order(50, 3, shuffle=True, seed=1)
    assert a.tolist() == b.tolist()  # seeded
    assert a.tolist() != c.tolist()  # seed matters
    assert a.tolist() != sample_order(50, 3, shuffle=False, seed=0).tolist()
    assert np.bincount(a).tolist() == [3] * 50  # each sample exactly `repeat` times
    assert a.tolist() == np.random.default_rng(0).permutation(np.tile(np.arange(50), 3)).tolist()
