"""The two command-line fronts, run as subprocesses: success output, and bad inputs ->
one ``error:`` line, exit status 2, no output file (and no temporary left behind)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from datatest_helpers import ALPACA, BAD_INPUTS, TOKENIZER, run_cli


def test_converter_cli_success(tmp_path, alpaca_records):
    out = tmp_path / "alpaca-data-conversation.json"
    proc = run_cli("alpaca_converter.py", "--data_path", ALPACA, "--output_path", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "read 999 records" in proc.stdout and "wrote 999 conversations" in proc.stdout
    assert str(out) in proc.stdout
    data = json.loads(out.read_text(encoding="utf-8"))
    assert len(data) == 999 and data[998]["id"] == "999"
    assert data[998]["conversations"][1]["value"] == alpaca_records[998]["output"]


def _truncated_real_alpaca(tmp_path) -> str:
    text = open(ALPACA, encoding="utf-8").read()
    path = tmp_path / "truncated.json"
    path.write_text(text[:12345], encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "name, fragments",
    [
        ("missing_output.json", ["record 0", "'output'"]),
        ("nonstring_input.json", ["record 0", "'input'", "expected a string"]),
        ("nonstring_instruction.json", ["record 1", "'instruction'"]),
        ("not_a_list.json", ["expected a list"]),
        ("record_not_object.json", ["record 1"]),
        ("malformed.json", ["invalid JSON at line 3 column"]),
        ("empty.json", ["empty"]),
        ("TRUNCATED", ["invalid JSON at line", "truncated"]),
        ("MISSING", ["file not found"]),
    ],
)
def test_converter_cli_bad_inputs(tmp_path, name, fragments):
    if name == "TRUNCATED":
        src = _truncated_real_alpaca(tmp_path)
    elif name == "MISSING":
        src = str(tmp_path / "nope.json")
    else:
        src = str(tmp_path / name)
        shutil.copy(os.path.join(BAD_INPUTS, name), src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "conv.json"
    proc = run_cli("alpaca_converter.py", "--data_path", src, "--output_path", str(out))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert src in lines[0]
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])
    assert "Traceback" not in proc.stderr
    assert os.listdir(out_dir) == []


def test_converter_cli_failure_keeps_previous_output(tmp_path):
    out = tmp_path / "conv.json"
    out.write_text("previous", encoding="utf-8")
    proc = run_cli("alpaca_converter.py", "--data_path", os.path.join(BAD_INPUTS, "missing_output.json"),
                   "--output_path", str(out))
    assert proc.returncode == 2
    assert out.read_text(encoding="utf-8") == "previous"
    assert os.listdir(tmp_path) == ["conv.json"]


def test_preprocess_cli_success(tmp_path, conversation_file):
    small = tmp_path / "small.json"
    small.write_text(json.dumps(json.load(open(conversation_file, encoding="utf-8"))[:40]), encoding="utf-8")
    out = tmp_path / "o" / "small.mindrecord"
    proc = run_cli(
        "llama_preprocess.py", "--input_glob", str(tmp_path / "sm*.json"), "--dataset_type", "qa",
        "--model_file", TOKENIZER, "--seq_length", "128", "--repeat", "2", "--shuffle", "1",
        "--output_file", str(out), "--no_progress",
    )
    assert proc.returncode == 0, proc.stderr
    assert "records read      : 40" in proc.stdout
    assert "samples written   : 80" in proc.stdout
    assert "records/s" in proc.stdout and "tokens/s" in proc.stdout
    assert sorted(os.listdir(out.parent)) == ["small.mindrecord", "small.mindrecord.db", "small.mindrecord.json"]
    meta = json.loads((out.parent / "small.mindrecord.json").read_text())
    assert meta["num_samples"] == 80 and meta["seq_length"] == 128


@pytest.mark.parametrize(
    "case",
    ["bad_tokenizer", "missing_tokenizer", "no_match", "malformed_json", "seq_length_1",
     "alpaca_not_converted", "bad_structure", "bad_output_name", "all_skipped", "bad_pad_id"],
)
def test_preprocess_cli_bad_inputs(tmp_path, conversation_file, case):
    out_dir = tmp_path / "out"
    out = out_dir / "x.mindrecord"
    args = {
        "--input_glob": conversation_file, "--dataset_type": "qa", "--model_file": TOKENIZER,
        "--seq_length": "64", "--output_file": str(out),
    }
    expect: list[str]
    if case == "bad_tokenizer":
        args["--model_file"] = ALPACA
        expect = ["not a Hugging Face tokenizer.json", ALPACA]
    elif case == "missing_tokenizer":
        args["--model_file"] = str(tmp_path / "tokenizer.model")
        expect = ["not found", str(tmp_path / "tokenizer.model")]
    elif case == "no_match":
        args["--input_glob"] = str(tmp_path / "nothing*.json")
        expect = ["matches no files", "nothing*.json"]
    elif case == "malformed_json":
        args["--input_glob"] = os.path.join(BAD_INPUTS, "malformed.json")
        expect = ["malformed.json", "invalid JSON at line 3"]
    elif case == "seq_length_1":
        args["--seq_length"] = "1"
        expect = ["--seq_length 1", ">= 2"]
    elif case == "alpaca_not_converted":
        args["--input_glob"] = ALPACA
        expect = ["record 0", "'conversations'", "alpaca_converter"]
    elif case == "bad_structure":
        args["--input_glob"] = os.path.join(BAD_INPUTS, "conversation_nonstring_value.json")
        expect = ["record 0 (id '1') turn 1", "'value'"]
    elif case == "bad_output_name":
        # any name is accepted (MindFormers writes names without .mindrecord), but not one that
        # ends like a MindRecord's companion files
        args["--output_file"] = str(out_dir / "x.mindrecord.db")
        expect = ["x.mindrecord.db", "not ending in .db or .json"]
    elif case == "all_skipped":
        args["--seq_length"] = "4"  # every Alpaca prompt is longer than 5 tokens
        expect = ["all 999 conversations were skipped", "no response tokens within seq_length"]
    else:
        args["--pad_token_id"] = "32000"
        expect = ["pad token id 32000", "32000"]
    argv = [x for kv in args.items() for x in kv] + ["--no_progress"]
    proc = run_cli("llama_preprocess.py", *argv)
    assert proc.returncode == 2, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1, proc.stderr
    for frag in expect:
        assert frag in err[0], (frag, err[0])
    assert "Traceback" not in proc.stderr
    assert not out_dir.exists() or os.listdir(out_dir) == []
