"""Prompt templates (msllm.data.templates): rendering, tokenisation of segments, the generation
prompt, and the template name beside the data -- on the real LLaMA tokenizer."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from datatest_helpers import ALPACA, TOKENIZER, WIKI

from msllm.data.conversation import alpaca_to_conversation
from msllm.data.templates import (
    DEFAULT_TEMPLATE,
    TEMPLATE_NAMES,
    VICUNA_SYSTEM,
    encode_prompt,
    encode_segments,
    get_template,
    read_template_name,
)
from msllm.errors import MsllmError

I = -100  # noqa: E741  (IGNORE_INDEX, short for the tables below)

# A short two-turn conversation, tokenised by hand: each (piece, id) read off the real LLaMA
# vocabulary (examples/data/tokenizer.model); the pieces spell the rendered text.
TURNS = [("human", "Hi"), ("gpt", "Hello!"), ("human", "2+2?"), ("gpt", "4")]
SYSTEM_PIECES = [("▁A", 319), ("▁chat", 13563), ("▁between", 1546), ("▁a", 263), ("▁curious", 12758),
                 ("▁user", 1404), ("▁and", 322), ("▁an", 385), ("▁artificial", 23116),
                 ("▁intelligence", 21082), ("▁assistant", 20255), (".", 29889), ("▁The", 450),
                 ("▁assistant", 20255), ("▁gives", 4076), ("▁helpful", 8444), (",", 29892),
                 ("▁detailed", 13173), (",", 29892), ("▁and", 322), ("▁pol", 1248), ("ite", 568),
                 ("▁answers", 6089), ("▁to", 304), ("▁the", 278), ("▁user", 1404), ("'", 29915),
                 ("s", 29879), ("▁questions", 5155), (".", 29889)]
USER = [("▁US", 3148), ("ER", 1001), (":", 29901)]
ASSISTANT = [("▁A", 319), ("SS", 1799), ("IST", 9047), ("ANT", 13566), (":", 29901)]
# (piece, id, label)
VICUNA_EXPECTED = (
    [("<s>", 1, I)] + [(p, i, I) for p, i in SYSTEM_PIECES + USER + [("▁Hi", 6324)] + ASSISTANT]
    + [("▁Hello", 15043, 15043), ("!", 29991, 29991), ("</s>", 2, 2)]
    + [(p, i, I) for p, i in USER + [("▁", 29871), ("2", 29906), ("+", 29974), ("2", 29906), ("?", 29973)]
       + ASSISTANT]
    + [("▁", 29871, 29871), ("4", 29946, 29946), ("</s>", 2, 2)]
)
ALPACA_EXPECTED = [("<s>", 1, I), ("▁Hi", 6324, I), ("▁Hello", 15043, 15043), ("!", 29991, 29991), ("</s>", 2, 2),
                   ("<s>", 1, I), ("▁", 29871, I), ("2", 29906, I), ("+", 29974, I), ("2", 29906, I),
                   ("?", 29973, I), ("▁", 29871, 29871), ("4", 29946, 29946), ("</s>", 2, 2)]
NONE_EXPECTED = ALPACA_EXPECTED  # the same per-pair layout, without the Alpaca prompt's meaning


def _conversations():
    with open(ALPACA, encoding="utf-8") as fh:
        convs = alpaca_to_conversation(json.load(fh), ALPACA)
    return [[(t["from"], t["value"]) for t in c["conversations"]] for c in convs]


def test_names_default_and_unknown():
    assert TEMPLATE_NAMES == ("vicuna_v1.1", "alpaca", "none") and DEFAULT_TEMPLATE == "vicuna_v1.1"
    assert get_template("alpaca").name == "alpaca"
    with pytest.raises(MsllmError) as info:
        get_template("vicuna")
    for name in TEMPLATE_NAMES:
        assert name in str(info.value)


def test_vicuna_renders_fastchat_text():
    t = get_template("vicuna_v1.1")
    text = "".join(s for s, _ in t.segments(TURNS))
    # FastChat conv_vicuna_v1_1.get_prompt() (SeparatorStyle ADD_COLON_TWO, sep " ", sep2 "</s>")
    assert text == ("<s>" + VICUNA_SYSTEM + " USER: Hi ASSISTANT: Hello!</s>USER: 2+2? ASSISTANT: 4</s>")
    assert t.segments(TURNS) == [
        ("<s>" + VICUNA_SYSTEM + " USER: Hi ASSISTANT:", False), (" Hello!</s>", True),
        ("USER: 2+2? ASSISTANT:", False), (" 4</s>", True)]
    assert t.prompt(TURNS[:3]) == "<s>" + VICUNA_SYSTEM + " USER: Hi ASSISTANT: Hello!</s>USER: 2+2? ASSISTANT:"
    assert t.stop_strings == ["</s>"] and t.bos_once_per_sample
    # FastChat's `if message` rule: an empty message is "ROLE:" with no separator
    assert "".join(s for s, _ in t.segments([("human", ""), ("gpt", "x")])).endswith("USER:ASSISTANT: x</s>")
    assert get_template("alpaca").stop_strings == [] and not get_template("alpaca").bos_once_per_sample


@pytest.mark.parametrize("name, expected", [("vicuna_v1.1", VICUNA_EXPECTED), ("alpaca", ALPACA_EXPECTED),
                                            ("none", NONE_EXPECTED)])
def test_hand_checked_ids_and_labels(tokenizer, name, expected):
    ids, labels = encode_segments(tokenizer, get_template(name).segments(TURNS))
    assert ids == [i for _, i, _ in expected]
    assert labels == [lab for _, _, lab in expected]
    # the pieces written above are the tokenizer's
    assert [tokenizer._sp.id_to_piece(i) for i in ids] == [p for p, _, _ in expected]


def test_turn_errors():
    t = get_template("vicuna_v1.1")
    with pytest.raises(MsllmError, match="last turn must be a gpt"):
        t.segments(TURNS[:3])
    with pytest.raises(MsllmError, match="last turn must be a human"):
        t.prompt(TURNS)
    with pytest.raises(MsllmError, match="turn 1 has role 'human'"):
        t.segments([("human", "a"), ("human", "b")])


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_encode_prompt_is_exactly_what_training_saw(tokenizer, name):
    """For every real Alpaca record (and 100 two-turn conversations made of them): the prompt ids
    are the sample's first ids, the token before the answer is masked and the answer's first token
    is a target -- predict/chat feed the model what it was trained on."""
    t = get_template(name)
    convs = _conversations()
    multi = [convs[i] + convs[i + 1] for i in range(0, 200, 2)]
    for turns in convs + multi:
        ids, labels = encode_segments(tokenizer, t.segments(turns))
        for k in range(1, len(turns), 2):  # each gpt answer
            prompt = encode_prompt(tokenizer, t, turns[:k])
            n = len(prompt)
            assert ids[:n] == prompt
            assert labels[n - 1] == -100 and labels[n] == ids[n]
            assert t.prompt(turns[:k]) == "".join(s for s, _ in t.segments(turns))[: len(t.prompt(turns[:k]))]


def test_straddling_token_belongs_to_the_answer(tokenizer):
    """encode_segments' rule when a token spans a segment boundary (no template here makes one:
    built by hand): the token goes to the later segment."""
    ids, labels = encode_segments(tokenizer, [("<s>Say:", False), ("ok</s>", True)])
    assert [tokenizer._sp.id_to_piece(i) for i in ids] == ["<s>", "▁Say", ":", "ok", "</s>"]
    ids, labels = encode_segments(tokenizer, [("<s>Say: o", False), ("k</s>", True)])
    assert [tokenizer._sp.id_to_piece(i) for i in ids] == ["<s>", "▁Say", ":", "▁ok", "</s>"]
    assert labels == [-100, -100, -100, ids[3], 2]  # "▁ok" holds the prompt's "o": a target


def test_alpaca_template_is_the_earlier_layout(tokenizer):
    """`alpaca` = msllm's layout before templates: per pair [bos] + encode(human) masked, then
    encode(gpt) + [eos] kept (each text encoded alone), on all 999 real records and 2-turn joins."""
    convs = _conversations()
    t = get_template("alpaca")
    for turns in convs + [convs[i] + convs[i + 1] for i in range(0, 100, 2)]:
        ref_ids, ref_labels = [], []
        for (_, h), (_, g) in zip(turns[::2], turns[1::2]):
            p = [tokenizer.bos_id] + tokenizer.encode(h)
            a = tokenizer.encode(g) + [tokenizer.eos_id]
            ref_ids += p + a
            ref_labels += [-100] * len(p) + a
        assert encode_segments(tokenizer, t.segments(turns)) == (ref_ids, ref_labels)


def test_special_token_strings_are_tokens(tokenizer):
    """As MindFormers' tokenizer: "</s>" in text is the EOS id, the text around it is encoded apart."""
    assert tokenizer.encode_special("a</s>b<s><unk>") == tokenizer.encode("a") + [2] + tokenizer.encode("b") + [1, 0]
    assert tokenizer.encode("</s>") != [2]


def test_template_name_travels_with_the_data(tmp_path, conversation_file):
    from msllm.data.preprocess import preprocess_to_mindrecord

    small = tmp_path / "small.json"
    small.write_text(json.dumps(json.load(open(conversation_file, encoding="utf-8"))[:20]), encoding="utf-8")
    qa = tmp_path / "qa" / "a.mindrecord"
    preprocess_to_mindrecord(str(small), "qa", TOKENIZER, 512, str(qa), progress=False, template="vicuna_v1.1")
    assert read_template_name(str(qa)) == "vicuna_v1.1"
    assert read_template_name(str(qa.parent)) == "vicuna_v1.1"
    wiki = tmp_path / "wiki" / "w.mindrecord"
    preprocess_to_mindrecord(WIKI, "wiki", TOKENIZER, 512, str(wiki), progress=False)
    assert read_template_name(str(wiki)) is None
    with pytest.raises(MsllmError, match="applies to --dataset_type qa"):
        preprocess_to_mindrecord(WIKI, "wiki", TOKENIZER, 512, str(tmp_path / "x"), progress=False, template="none")
    # a directory mixing templates is refused
    other = tmp_path / "qa" / "b.mindrecord"
    preprocess_to_mindrecord(str(small), "qa", TOKENIZER, 512, str(other), progress=False, template="none")
    with pytest.raises(MsllmError, match="different prompt templates"):
        read_template_name(str(qa.parent))
    # without a sidecar (e.g. MindFormers' own files): None
    bare = tmp_path / "bare"
    bare.mkdir()
    for suffix in ("", ".db"):
        shutil.copy(str(qa) + suffix, bare / ("a.mindrecord" + suffix))
    assert read_template_name(str(bare)) is None
    assert os.path.isfile(str(qa) + ".json")
