"""Alpaca -> conversation conversion and conversation JSON validation, on the real Alpaca data."""

from __future__ import annotations

import json
import os

import pytest
from datatest_helpers import ALPACA, BAD_INPUTS

from msllm.data.conversation import (
    SKIP_EMPTY,
    SKIP_NO_REPLY,
    SKIP_NOT_ALTERNATING,
    alpaca_to_conversation,
    conversation_skip_reason,
    convert_alpaca_file,
    load_conversation_file,
    load_json_file,
)
from msllm.errors import MsllmError

# The Stanford Alpaca templates, written out literally (independent of the module's constants).
NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:"
)
WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
    "{instruction}\n\n### Input:\n{input}\n\n### Response:"
)


def test_real_records_use_both_templates_exactly(alpaca_records):
    conv = alpaca_to_conversation(alpaca_records, ALPACA)
    assert len(conv) == len(alpaca_records) == 999
    assert [c["id"] for c in conv] == [str(i) for i in range(1, 1000)]
    n_input = 0
    for rec, c in zip(alpaca_records, conv):
        assert set(c) == {"id", "conversations"}
        human, gpt = c["conversations"]
        assert human["from"] == "human" and gpt["from"] == "gpt"
        assert gpt["value"] == rec["output"]
        if rec["input"]:
            n_input += 1
            assert human["value"] == WITH_INPUT.format(instruction=rec["instruction"], input=rec["input"])
        else:
            assert human["value"] == NO_INPUT.format(instruction=rec["instruction"])
    # the real file has both kinds
    assert 0 < n_input < 999


def test_first_real_record_prompt_literal(alpaca_records):
    first = alpaca_to_conversation(alpaca_records[:1], ALPACA)[0]
    assert first["conversations"][0]["value"] == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nDescribe a process of making crepes.\n\n### Response:"
    )


def test_missing_or_null_input_uses_no_input_template():
    conv = alpaca_to_conversation(
        [{"instruction": "A", "output": "B"}, {"instruction": "A", "input": None, "output": "B"}], "x.json"
    )
    assert conv[0]["conversations"][0]["value"] == NO_INPUT.format(instruction="A")
    assert conv[1]["conversations"][0]["value"] == NO_INPUT.format(instruction="A")


def test_convert_file_round_trip(tmp_path, alpaca_records):
    out = tmp_path / "sub" / "conv.json"
    summary = convert_alpaca_file(ALPACA, str(out))
    assert summary["records_read"] == summary["records_written"] == 999
    assert summary["with_input"] == sum(1 for r in alpaca_records if r["input"])
    assert json.loads(out.read_text(encoding="utf-8")) == alpaca_to_conversation(alpaca_records, ALPACA)
    assert load_conversation_file(str(out))[5] == [
        ("human", NO_INPUT.format(instruction=alpaca_records[5]["instruction"])
         if not alpaca_records[5]["input"] else
         WITH_INPUT.format(instruction=alpaca_records[5]["instruction"], input=alpaca_records[5]["input"])),
        ("gpt", alpaca_records[5]["output"]),
    ]
    assert os.listdir(out.parent) == ["conv.json"]  # no temp file left


@pytest.mark.parametrize(
    "name, fragments",
    [
        ("missing_output.json", ["record 0", "'output'"]),
        ("nonstring_input.json", ["record 0", "'input'", "list", "expected a string"]),
        ("nonstring_instruction.json", ["record 1", "'instruction'", "int"]),
        ("not_a_list.json", ["top level", "dict", "expected a list"]),
        ("record_not_object.json", ["record 1", "str"]),
        ("malformed.json", ["invalid JSON", "line 3", "column"]),
        ("empty.json", ["empty"]),
    ],
)
def test_alpaca_errors_name_file_record_key(name, fragments):
    path = os.path.join(BAD_INPUTS, name)
    with pytest.raises(MsllmError) as info:
        alpaca_to_conversation(load_json_file(path), path)
    msg = str(info.value)
    assert path in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_truncated_real_file_reports_line_and_column(tmp_path):
    text = open(ALPACA, encoding="utf-8").read()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(MsllmError, match=r"line \d+ column \d+.*truncated"):
        load_json_file(str(cut))


@pytest.mark.parametrize(
    "name, fragments",
    [
        ("conversation_nonstring_value.json", ["record 0 (id '1') turn 1", "'value'", "int"]),
        ("conversation_not_list.json", ["record 0 (id '1')", "'conversations'", "dict"]),
    ],
)
def test_conversation_structure_errors(name, fragments):
    path = os.path.join(BAD_INPUTS, name)
    with pytest.raises(MsllmError) as info:
        load_conversation_file(path)
    for frag in [path, *fragments]:
        assert frag in str(info.value)


def test_alpaca_file_given_as_conversations_hints_converter():
    with pytest.raises(MsllmError, match="alpaca_converter"):
        load_conversation_file(ALPACA)


def test_skip_reasons():
    assert conversation_skip_reason([]) == SKIP_EMPTY
    assert conversation_skip_reason([("gpt", "a"), ("human", "b")]) == SKIP_NOT_ALTERNATING
    assert conversation_skip_reason([("human", "a"), ("human", "b")]) == SKIP_NOT_ALTERNATING
    assert conversation_skip_reason([("human", "a"), ("system", "b")]) == SKIP_NOT_ALTERNATING
    assert conversation_skip_reason([("human", "a"), ("gpt", "b"), ("human", "c")]) == SKIP_NO_REPLY
    assert conversation_skip_reason([("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d")]) is None
