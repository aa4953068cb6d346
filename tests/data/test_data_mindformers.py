"""msllm's llama_preprocess.py against MindFormers' own: the samples, the masking, the flags.

The reference below re-implements, from reading it, MindFormers'
``mindformers/tools/dataset_preprocess/llama/llama_preprocess.py`` at r1.0 (blob de6f04262be2,
commit 2a53834872247286fbc846dace915c55c9ecda69) with its ``conversation.py``
(``conv_vicuna_v1_1``) and its tokenizer (``LlamaTokenizer`` with ``add_bos_token`` and
``add_eos_token`` set, lines 242/244; ``PreTrainedTokenizer.tokenize`` splits on the special
tokens and encodes each piece with SentencePiece). It uses SentencePiece directly, not msllm's
code. Line numbers refer to that file.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import sentencepiece as spm
from datatest_helpers import ALPACA, TOKENIZER, WIKI, run_cli

from msllm.data.conversation import alpaca_to_conversation
from msllm.data.mindrecord import read_mindrecord_arrays, resolve_mindrecord_files
from msllm.data.preprocess import SKIP_NO_RESPONSE, build_qa_sample
from msllm.data.wiki import clean_wikitext, read_wiki_file

SP = spm.SentencePieceProcessor(model_file=TOKENIZER)
SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the user's questions.")
_SPECIAL = {"<s>": 1, "</s>": 2, "<unk>": 0}
_SPLIT = re.compile("(</s>|<unk>|<s>)")
IGNORE = -100


def mf_tokenizer(text: str) -> list[int]:
    """MindFormers' ``tokenizer(text)['input_ids']`` with add_bos_token/add_eos_token."""
    ids = []
    for chunk in _SPLIT.split(text):
        if chunk:
            ids.extend([_SPECIAL[chunk]] if chunk in _SPECIAL else SP.encode(chunk))
    return [1] + ids + [2]


def mf_prompt(turns) -> str:
    """conversation.py get_prompt, ADD_COLON_TWO, roles USER/ASSISTANT, sep " ", sep2 "</s>"."""
    seps = [" ", "</s>"]
    ret = SYSTEM + seps[0]
    for i, (role, msg) in enumerate(turns):
        name = "USER" if role == "human" else "ASSISTANT"
        ret += name + ": " + msg + seps[i % 2] if msg else name + ":"
    return ret


def mf_sample(turns, seq_length: int):
    """llama_preprocess.py ``preprocess`` for one conversation, ``seq_length`` = the script's
    ``args.seq_length + 1``: returns (input_ids, labels) as the script writes them."""
    conversation = mf_prompt(turns)
    sep = " ASSISTANT: "
    rounds = conversation.split("</s>")                              # l.114
    ids = [1]                                                        # l.115
    for rou in rounds:
        if rou == "":
            break
        ids.extend(mf_tokenizer(rou)[1:])                            # l.120-121
    padded = ids + [0] * max(0, seq_length - len(ids))               # l.125 tokenizer._pad
    input_ids = padded[:seq_length]                                  # l.126
    target = np.array(padded)                                        # l.129
    total_len = int(np.not_equal(target, 0).sum())                   # l.130
    cur_len = 1                                                      # l.131
    target[:cur_len] = IGNORE
    for rou in rounds:
        if rou == "":
            break
        parts = rou.split(sep)                                       # l.136
        if len(parts) != 2:
            break
        parts[0] += sep                                              # l.139
        round_len = len(mf_tokenizer(rou)) - 1                       # l.140
        instruction_len = len(mf_tokenizer(parts[0])) - 3            # l.141
        target[cur_len: cur_len + instruction_len] = IGNORE          # l.143
        cur_len += round_len                                         # l.145
    target[cur_len:] = IGNORE                                        # l.146
    if cur_len < seq_length:
        if cur_len != total_len:                                     # l.149-150
            target[:] = IGNORE
    else:
        target = target[:seq_length]                                 # l.152
    return input_ids, target.tolist()


def _alpaca_turns():
    with open(ALPACA, encoding="utf-8") as fh:
        convs = alpaca_to_conversation(json.load(fh), ALPACA)
    return [[(t["from"], t["value"]) for t in c["conversations"]] for c in convs]


def _msllm_row(tokenizer, turns, seq_length):
    res = build_qa_sample(tokenizer, turns, seq_length, "vicuna_v1.1")
    if res.skip_reason is not None:
        return None
    n = seq_length + 1
    ids = res.input_ids.tolist() + [0] * (n - len(res.input_ids))
    labels = res.labels.tolist() + [IGNORE] * (n - len(res.labels))
    return ids, labels


@pytest.mark.parametrize("seq_length", [256, 4096])
def test_vicuna_samples_equal_mindformers_on_real_data(tokenizer, seq_length):
    """All 999 real Alpaca conversations and 150 two-turn ones: identical input_ids, and the same
    labels (MindFormers' length-based masking agrees with msllm's wherever it writes a target)."""
    convs = _alpaca_turns()
    multi = [convs[i] + convs[i + 1] for i in range(0, 300, 2)]
    mf_only = 0
    for turns in convs + multi:
        ref_ids, ref_labels = mf_sample(turns, seq_length + 1)
        ours = _msllm_row(tokenizer, turns, seq_length)
        if ours is None:  # msllm skips a sample with nothing to learn; MindFormers writes it
            assert all(v == IGNORE for v in ref_labels[1:])
            mf_only += 1
            continue
        assert ours[0] == ref_ids
        assert ours[1] == ref_labels
    assert mf_only == (2 if seq_length == 256 else 0)


def test_where_mindformers_masking_differs():
    """MindFormers finds the answer by splitting the rendered text at " ASSISTANT: " and "</s>"
    (l.114, l.136) and checks the length against the count of non-pad ids (l.130, l.149); text
    that contains those strings, or "<unk>" (= the pad id 0), breaks its masking. msllm masks
    by segment, so the input_ids stay identical and only the labels differ, as documented."""
    from msllm.data.tokenizer import LlamaTokenizer

    tok = LlamaTokenizer(TOKENIZER)
    enc = SP.encode
    cases = {  # name: (turns, msllm's targets: each answer's tokens and its </s>)
        # a user turn quoting the template: MindFormers' split finds 3 parts and stops masking
        "quotes template": ([("human", "Write 'ASSISTANT: hi' ASSISTANT: please"), ("gpt", "Done.")],
                            enc("Done.") + [2]),
        # an answer containing "</s>": MindFormers splits the round there
        "eos in answer": ([("human", "Hi"), ("gpt", "a</s>b"), ("human", "More"), ("gpt", "Yes.")],
                          enc("a") + [2] + enc("b") + [2] + enc("Yes.") + [2]),
        # "<unk>" is the pad id 0: MindFormers' length check (l.149) fails
        # (the space after "ASSISTANT:" ends its chunk, as the token "▁" 29871, and opens the answer)
        "unk string": ([("human", "Say <unk>"), ("gpt", "<unk> ok")], [29871, 0] + enc(" ok") + [2]),
    }
    for name, (turns, expected) in cases.items():
        ref_ids, ref_labels = mf_sample(turns, 513)
        ids, labels = _msllm_row(tok, turns, 512)
        assert ids == ref_ids, name
        assert all(v == IGNORE for v in ref_labels), name  # MindFormers: nothing left to learn
        assert [v for v in labels if v != IGNORE] == expected, name
    # the ordinary case stays equal
    ok = [("human", "Hi"), ("gpt", "Hello!")]
    assert _msllm_row(tok, ok, 512) == tuple(mf_sample(ok, 513))


def test_leading_gpt_turn_dropped_as_mindformers(tokenizer):
    turns = [("gpt", "Welcome."), ("human", "Hi"), ("gpt", "Hello!")]
    ref = mf_sample(turns[1:], 513)  # l.101-103: "Skip the first one if it is not from human"
    assert _msllm_row(tokenizer, turns, 512) == tuple(ref)


def test_cli_rows_equal_mindformers_rows(tmp_path, conversation_file):
    """The command with MindFormers' flags (--tokenizer llama, --file_partition 1, output name
    without .mindrecord) and --shuffle 0 writes MindFormers' rows in MindFormers' order, minus
    the rows MindFormers writes with every label ignored."""
    small = tmp_path / "conv.json"
    records = json.load(open(conversation_file, encoding="utf-8"))[:120]
    small.write_text(json.dumps(records), encoding="utf-8")
    out = tmp_path / "out" / "alpaca256"
    proc = run_cli("llama_preprocess.py", "--dataset_type", "qa", "--input_glob", str(small),
                   "--tokenizer", "llama", "--model_file", TOKENIZER, "--seq_length", "256",
                   "--file_partition", "1", "--output_file", str(out), "--shuffle", "0", "--no_progress")
    assert proc.returncode == 0, proc.stderr
    assert "template vicuna_v1.1" in proc.stdout
    assert sorted(os.listdir(out.parent)) == ["alpaca256", "alpaca256.db", "alpaca256.json"]
    rows = read_mindrecord_arrays(str(out))
    ref = [mf_sample([(t["from"], t["value"]) for t in r["conversations"]], 257) for r in records]
    ref = [r for r in ref if any(v != IGNORE for v in r[1])]
    assert rows["input_ids"].tolist() == [r[0] for r in ref]
    assert rows["labels"].tolist() == [r[1] for r in ref]
    truncated = sum(1 for r in records if len(mf_tokenizer(mf_prompt(
        [(t["from"], t["value"]) for t in r["conversations"]]))) - 1 > 257)
    assert f"truncated         : {truncated}\n" in proc.stdout and truncated > 0


def test_file_partition_shards_are_named_and_read_as_mindformers(tmp_path, conversation_file):
    from msllm.data.dataset import count_samples
    from msllm.data.mindrecord import check_dataset
    from msllm.data.templates import read_template_name

    out = tmp_path / "parts" / "alpaca.mindrecord"
    proc = run_cli("llama_preprocess.py", "--dataset_type", "qa", "--input_glob", conversation_file,
                   "--model_file", TOKENIZER, "--seq_length", "128", "--file_partition", "3",
                   "--output_file", str(out), "--samples_num", "100", "--no_progress")
    assert proc.returncode == 0, proc.stderr
    names = [f"alpaca.mindrecord{i}" for i in range(3)]  # FileWriter(shard_num=3): name + index
    assert sorted(os.listdir(out.parent)) == sorted(n + s for n in names for s in ("", ".db", ".json"))
    full = [str(out.parent / n) for n in names]
    assert resolve_mindrecord_files(str(out.parent)) == full
    assert resolve_mindrecord_files(full[1]) == full  # one shard name -> the whole group
    assert check_dataset(full[2], 128) == full
    assert count_samples(full) == 100
    assert read_template_name(full[0]) == "vicuna_v1.1"
    meta = json.load(open(full[0] + ".json"))
    assert meta["file_partition"] == 3 and meta["data_files"] == names and meta["num_samples"] == 100
    assert "not used" in proc.stdout
    os.remove(full[2])
    with pytest.raises(Exception, match="missing"):
        resolve_mindrecord_files(full[0])


def test_dataset_type_defaults_to_wiki_and_tokenizer_flag(tmp_path):
    out = tmp_path / "wiki"
    proc = run_cli("llama_preprocess.py", "--input_glob", WIKI, "--model_file", TOKENIZER,
                   "--seq_length", "512", "--output_file", str(out), "--no_progress")
    assert proc.returncode == 0, proc.stderr
    assert "(wiki)" in proc.stdout
    assert json.load(open(str(out) + ".json"))["dataset_type"] == "wiki"
    bad = run_cli("llama_preprocess.py", "--input_glob", WIKI, "--model_file", TOKENIZER,
                  "--tokenizer", "gpt2", "--output_file", str(tmp_path / "x"))
    assert bad.returncode == 2 and "--tokenizer" in bad.stderr
    qa_only = run_cli("llama_preprocess.py", "--input_glob", WIKI, "--model_file", TOKENIZER,
                      "--template", "alpaca", "--output_file", str(tmp_path / "y"))
    assert qa_only.returncode == 2 and "applies to --dataset_type qa" in qa_only.stderr


# A WikiText-103-style file written for this test (WikiText's layout: " = Heading = " lines,
# " @-@ " / " @,@ " / " @.@ " number markup, spaced punctuation, " \n" blank lines, <unk>).
WIKITEXT = (
    " \n = Test Article = \n \n"
    " The bridge is 1 @,@ 250 m long and 12 @.@ 5 m wide ; it opened in 1932 . \n \n"
    " = = History = = \n \n"
    " A two @-@ lane road ( the old route ) crossed the river at <unk> . \n \n"
)
CLEANED_PARAGRAPHS = [  # by hand, applying clean_wikitext's rules to the text above
    "The bridge is 1,250 m long and 12.5 m wide; it opened in 1932. ",
    "A two-lane road (the old route) crossed the river at <unk>. ",
]


def test_wikitext_cleaned_as_mindformers(tmp_path, tokenizer):
    assert clean_wikitext(" 1 @,@ 250 m ( a ) ; x") == " 1,250 m (a); x"
    path = tmp_path / "wiki.train.tokens"
    path.write_text(WIKITEXT, encoding="utf-8")
    docs, is_wikitext = read_wiki_file(str(path))
    assert is_wikitext and [d.strip() + " " for d in docs] == CLEANED_PARAGRAPHS
    # tokenize_wiki (l.186-197): tokenizer(para) with BOS and EOS per paragraph, one stream,
    # chunks of seq_length + 1, the short last chunk dropped
    stream = [t for d in docs for t in mf_tokenizer(d)]
    assert 0 in stream  # "<unk>" is one token, as MindFormers' tokenizer makes it
    out = tmp_path / "wt"
    proc = run_cli("llama_preprocess.py", "--input_glob", str(path), "--model_file", TOKENIZER,
                   "--seq_length", "15", "--shuffle", "0", "--output_file", str(out), "--no_progress")
    assert proc.returncode == 0, proc.stderr
    assert "1 WikiText file(s) cleaned" in proc.stdout
    blocks = read_mindrecord_arrays(str(out))["input_ids"]
    n = len(stream) // 16
    assert blocks.tolist() == [stream[i * 16:(i + 1) * 16] for i in range(n)]
    # plain text is not WikiText: one document per line
    assert read_wiki_file(WIKI)[1] is False


def test_input_ids_only_labels_match_mindformers_loss_mask():
    """input_columns: ["input_ids"]: MindFormers' LlamaForCausalLM without labels trains target t
    (= input_ids[t + 1]) where the input token input_ids[t] != pad (llama.py construct:
    labels = input_ids[:, 1:], input_mask = tokens != pad_token_id)."""
    from msllm.data.dataset import check_input_columns, labels_from_input_ids

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 32000, size=(4, 33)).astype(np.int32)
    ids[1, 20:] = 0  # padding
    ids[2, 5] = 0   # an unk inside the text
    labels = labels_from_input_ids(ids, pad_token_id=0)
    tokens, mf_labels = ids[:, :-1], ids[:, 1:]
    mf_mask = tokens != 0
    ours_mask = labels[:, 1:] != IGNORE
    assert np.array_equal(ours_mask, mf_mask)
    assert np.array_equal(labels[:, 1:][ours_mask], mf_labels[mf_mask])
    assert check_input_columns(["input_ids"]) is False and check_input_columns(["labels", "input_ids"]) is True
    with pytest.raises(Exception, match="input_columns"):
        check_input_columns(["input_ids", "attention_mask"])


def test_skipped_sample_reason(tokenizer):
    long_prompt = [("human", "word " * 300), ("gpt", "ok")]
    assert build_qa_sample(tokenizer, long_prompt, 64, "vicuna_v1.1").skip_reason == SKIP_NO_RESPONSE


def test_train_data_with_input_ids_only(tmp_path, conversation_file):
    """build_train_data(input_columns=["input_ids"]) feeds labels derived from input_ids."""
    from msllm.data.dataset import build_train_data, labels_from_input_ids
    from msllm.data.preprocess import preprocess_to_mindrecord

    small = tmp_path / "c.json"
    small.write_text(json.dumps(json.load(open(conversation_file, encoding="utf-8"))[:12]), encoding="utf-8")
    path = str(tmp_path / "d.mindrecord")
    preprocess_to_mindrecord(str(small), "qa", TOKENIZER, 128, path, progress=False, template="vicuna_v1.1")
    stored = read_mindrecord_arrays(path)
    for cols, derived in ((["input_ids"], True), (["input_ids", "labels"], False)):
        data = build_train_data(path, 128, 4, False, True, 0, 1, input_columns=cols, pad_token_id=0)
        seen = 0
        for ids, labels in data.epoch_batches(0):
            ids, labels = ids.asnumpy(), labels.asnumpy()
            want = labels_from_input_ids(ids, 0) if derived else stored["labels"][seen:seen + 4]
            assert np.array_equal(labels, want)
            seen += 4
        assert seen == 12
    assert not np.array_equal(labels_from_input_ids(stored["input_ids"], 0), stored["labels"])
