"""Bad evaluation input: one clear error naming the file and line (exit 2 from tools/evaluate.py,
no results file); plus the data-parallel helpers' exactness and determinism."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from evaltest_helpers import EVAL_DATA, REPO
from msllm.errors import MsllmError
from msllm.eval import dist
from msllm.eval.tasks import boolq, ceval, gsm8k, mc_jsonl, mmlu, ppl


@pytest.fixture
def mmlu_copy(tmp_path):
    d = tmp_path / "mmlu"
    shutil.copytree(os.path.join(EVAL_DATA, "mmlu"), d)
    return d


def test_missing_split_file(mmlu_copy):
    os.remove(mmlu_copy / "dev" / "marketing_dev.csv")
    with pytest.raises(MsllmError, match=r"marketing_dev\.csv: missing \(MMLU dev questions: 5-shot"):
        mmlu.load(str(mmlu_copy), 5)
    mmlu.load(str(mmlu_copy), 0)  # 0-shot needs no dev split
    with pytest.raises(MsllmError, match="no MMLU test files"):
        mmlu.load(str(mmlu_copy / "dev"), 0)


def test_csv_row_with_wrong_number_of_columns(mmlu_copy):
    path = mmlu_copy / "test" / "astronomy_test.csv"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines.insert(3, "What is a star?,gas,rock,ice\n")
    path.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(MsllmError, match=r"astronomy_test\.csv:4: 4 columns, expected 6"):
        mmlu.load(str(mmlu_copy))


def test_answer_letter_outside_a_to_d(mmlu_copy):
    path = mmlu_copy / "test" / "marketing_test.csv"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("Which one?,w,x,y,z,E\n")
    n = len(path.read_text(encoding="utf-8").splitlines())
    with pytest.raises(MsllmError, match=rf"marketing_test\.csv:{n}: answer 'E' is not one of A, B, C, D"):
        mmlu.load(str(mmlu_copy))


def test_empty_task(tmp_path, mmlu_copy):
    (mmlu_copy / "test" / "astronomy_test.csv").write_text("", encoding="utf-8")
    with pytest.raises(MsllmError, match=r"astronomy_test\.csv: no questions to evaluate \(empty task\)"):
        mmlu.load(str(mmlu_copy))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "dev.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(MsllmError, match="empty task"):
        boolq.load(str(tmp_path / "b"))


@pytest.mark.parametrize("line,message", [
    ('{"question": "q", "passage": "p"', r"dev\.jsonl: invalid JSON at line 3 column"),
    ('{"question": "q", "passage": "p"}', r"dev\.jsonl:3: missing key 'answer'"),
    ('{"question": "q", "passage": "p", "answer": "yes"}', r"dev\.jsonl:3: 'answer' is str, expected bool"),
    ('["q"]', r"dev\.jsonl:3: expected a JSON object"),
])
def test_boolq_bad_records(tmp_path, line, message):
    good = open(os.path.join(EVAL_DATA, "boolq", "dev.jsonl"), encoding="utf-8").readline()
    (tmp_path / "dev.jsonl").write_text(good + good + line + "\n", encoding="utf-8")
    with pytest.raises(MsllmError, match=message):
        boolq.load(str(tmp_path))


def test_other_formats_name_file_and_line(tmp_path):
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "42"}\n', encoding="utf-8")
    with pytest.raises(MsllmError, match=r"test\.jsonl:1: 'answer' has no '#### N'"):
        gsm8k.load(str(tmp_path), 0)
    with pytest.raises(MsllmError, match=r"train\.jsonl: missing .*--num_fewshot 0"):
        gsm8k.load(os.path.join(EVAL_DATA, "gsm8k"), 5)
    mc = tmp_path / "mc.jsonl"
    mc.write_text('{"question": "q", "choices": ["a", "b"], "answer": 1}\n'
                  '{"question": "q", "choices": ["a", "b"], "answer": 2}\n', encoding="utf-8")
    with pytest.raises(MsllmError, match=r"mc\.jsonl:2: answer index 2 is outside 0\.\.1"):
        mc_jsonl.load(str(mc))
    d = tmp_path / "ceval"
    shutil.copytree(os.path.join(EVAL_DATA, "ceval"), d)
    (d / "val" / "computer_network_val.csv").write_text("id,question,A,B,C,D\n0,q,a,b,c,d\n", encoding="utf-8")
    with pytest.raises(MsllmError, match=r"computer_network_val\.csv:1: header"):
        ceval.load(str(d))
    with pytest.raises(MsllmError, match="missing"):
        ppl.load(str(tmp_path / "nope.txt"))


def test_evaluate_cli_exits_2_with_one_error_line(tmp_path, mmlu_copy):
    path = mmlu_copy / "test" / "astronomy_test.csv"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("Which one?,w,x,y,z,F\n")
    cmd = [sys.executable, os.path.join(REPO, "tools", "evaluate.py"), "--config",
           os.path.join(REPO, "configs", "llama", "run_llama_tiny.yaml"), "--load_checkpoint", str(tmp_path),
           "--task", "mmlu", "--data_dir", str(mmlu_copy), "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "astronomy_test.csv:" in lines[0]
    assert "answer 'F' is not one of A, B, C, D" in lines[0]
    assert not (tmp_path / "out" / "eval").exists()


def test_dist_records_round_trip_exactly_and_assignment_is_deterministic():
    rng = np.random.default_rng(3)
    records = {i: rng.standard_normal(int(rng.integers(0, 6))) * 10.0 ** rng.integers(-30, 30) for i in range(50)}
    records[7] = np.array([np.pi, -0.0, 1e-300, 2.0 ** 52 + 1])
    flat = np.frombuffer(dist.encode(records).tobytes(), np.float64)   # what travels: the bytes
    back = dist.decode(flat)
    assert back.keys() == records.keys()
    for k in records:
        assert np.array_equal(back[k].view(np.uint64), np.asarray(records[k], np.float64).view(np.uint64))
    costs = [int(c) for c in rng.integers(1, 100, 40)]
    owners = dist.assign(costs, 3)
    assert owners == dist.assign(list(costs), 3) and set(owners) == {0, 1, 2}
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(costs)
    json.dumps(owners)
