"""Preference pairs for DPO (``llama_preprocess.py --dataset_type dpo``, msllm.data.preference) with the real
SmolLM2 tokenizer and chat template: MindSpeed-LLM's string records, TRL's conversational records and TRL's
implicit-prompt records of the same content give the same rows; the rows equal transformers'
``apply_chat_template`` ids and the labels are exactly the ids after the prompt (TRL's completion); bad records
are one error naming the file, record and key, with nothing written. The token-level equality with TRL's own
tokenization is in tests/training/test_dpo_trl.py (it needs a DPOTrainer)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO
from msllm.data.preference import PAIR_COLUMNS, preprocess_preference, read_preference_arrays
from msllm.errors import MsllmError

SEQ = 64
PROMPT, SYSTEM = "Name a primary colour.", "You answer in one word."
CHOSEN, REJECTED = "Red.", "Banana, probably."

MINDSPEED = {"instruction": PROMPT, "system": SYSTEM, "chosen": CHOSEN, "rejected": REJECTED}
TRL_CONV = {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}],
            "chosen": [{"role": "assistant", "content": CHOSEN}],
            "rejected": [{"role": "assistant", "content": REJECTED}]}
TRL_IMPLICIT = {"chosen": TRL_CONV["prompt"] + TRL_CONV["chosen"], "rejected": TRL_CONV["prompt"] + TRL_CONV["rejected"]}


def _write(path, records, jsonl=False):
    with open(path, "w", encoding="utf-8") as fh:
        if jsonl:
            fh.write("\n".join(json.dumps(r) for r in records) + "\n")
        else:
            json.dump(records, fh)
    return str(path)


@pytest.fixture(scope="module")
def three_formats(tmp_path_factory, smollm2_dir):
    d = tmp_path_factory.mktemp("pref")
    out = {}
    for name, rec, jsonl in (("mindspeed", MINDSPEED, True), ("trl", TRL_CONV, False), ("implicit", TRL_IMPLICIT, False)):
        src = _write(d / f"{name}.{'jsonl' if jsonl else 'json'}", [rec], jsonl)
        mr = str(d / f"{name}.mindrecord")
        summary = preprocess_preference(src, smollm2_dir, SEQ, mr, shuffle=False)
        assert summary["pairs_written"] == 1 and summary["skipped"] == {}
        out[name] = read_preference_arrays(mr)
    return out


def test_three_formats_give_the_same_rows(three_formats):
    ref = three_formats["trl"]
    assert set(ref) == set(PAIR_COLUMNS)
    for name in ("mindspeed", "implicit"):
        for col in PAIR_COLUMNS:
            np.testing.assert_array_equal(three_formats[name][col], ref[col], err_msg=f"{name} {col}")


def test_rows_are_apply_chat_template_and_labels_the_completion(three_formats, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rows = three_formats["trl"]
    prompt = tok.apply_chat_template(TRL_CONV["prompt"], add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    for side in ("chosen", "rejected"):
        text = tok.apply_chat_template(TRL_CONV["prompt"] + TRL_CONV[side], tokenize=False)
        full = tok(text, add_special_tokens=False)["input_ids"]
        ids, lab = rows[f"{side}_input_ids"][0], rows[f"{side}_labels"][0]
        assert ids.shape == (SEQ + 1,) and lab.shape == (SEQ + 1,)
        np.testing.assert_array_equal(ids[:len(full)], full)
        assert full[:len(prompt_ids)] == prompt_ids
        np.testing.assert_array_equal(lab[:len(prompt_ids)], -100)
        np.testing.assert_array_equal(lab[len(prompt_ids):len(full)], full[len(prompt_ids):])
        np.testing.assert_array_equal(lab[len(full):], -100)
        completion = tok.decode(full[len(prompt_ids):])
        assert completion == TRL_CONV[side][0]["content"] + "<|im_end|>\n"


def test_long_pairs_are_cut_and_prompts_that_fill_the_row_skipped(tmp_path, smollm2_dir):
    long = dict(MINDSPEED, chosen="word " * 100)
    huge = dict(MINDSPEED, instruction="word " * 200)
    mr = str(tmp_path / "x.mindrecord")
    s = preprocess_preference(_write(tmp_path / "x.json", [MINDSPEED, long, huge]), smollm2_dir, SEQ, mr, shuffle=False)
    assert s["pairs_written"] == 2 and s["truncated"] == 1
    assert list(s["skipped"].values()) == [1] and "prompt fills" in next(iter(s["skipped"]))
    rows = read_preference_arrays(mr)
    assert (rows["chosen_labels"][1] != -100).sum() > 0 and rows["chosen_input_ids"].shape == (2, SEQ + 1)


@pytest.mark.parametrize("record, words", [
    ({"instruction": PROMPT, "chosen": CHOSEN}, ["record 1", "'rejected'"]),
    ({"chosen": CHOSEN, "rejected": REJECTED}, ["record 1", "prompt keys"]),
    ({"prompt": PROMPT, "chosen": 3, "rejected": REJECTED}, ["record 1", "'chosen'", "expected a string"]),
    ({"prompt": [{"role": "user", "content": PROMPT}], "chosen": [{"role": "bot", "content": "x"}],
      "rejected": TRL_CONV["rejected"]}, ["record 1", "'chosen' message 0"]),
    ({"prompt": TRL_CONV["prompt"], "chosen": TRL_CONV["chosen"] * 2, "rejected": TRL_CONV["rejected"]},
     ["record 1", "exactly one assistant message"]),
])
def test_bad_record_is_one_error_naming_file_record_and_key(tmp_path, smollm2_dir, record, words):
    src = _write(tmp_path / "bad.json", [MINDSPEED, record])
    out = tmp_path / "bad.mindrecord"
    with pytest.raises(MsllmError) as err:
        preprocess_preference(src, smollm2_dir, SEQ, str(out))
    msg = str(err.value)
    assert src in msg and all(w in msg for w in words), msg
    assert not os.listdir(tmp_path) == [] and not out.exists()


def test_command_line_writes_pairs_and_refuses_bad_input(tmp_path, smollm2_dir):
    cmd = [sys.executable, os.path.join(REPO, "data_preprocess", "llama_preprocess.py"), "--dataset_type", "dpo",
           "--model_file", smollm2_dir, "--seq_length", str(SEQ)]
    good = _write(tmp_path / "good.json", [MINDSPEED, TRL_CONV])
    r = subprocess.run(cmd + ["--input_glob", good, "--output_file", str(tmp_path / "ok.mindrecord")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "pairs_written   : 2" in r.stdout
    assert read_preference_arrays(str(tmp_path / "ok.mindrecord"))["chosen_input_ids"].shape == (2, SEQ + 1)
    bad = _write(tmp_path / "bad.json", [MINDSPEED, {"prompt": PROMPT}])
    r = subprocess.run(cmd + ["--input_glob", bad, "--output_file", str(tmp_path / "no.mindrecord")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "bad.json: record 1" in r.stderr
    assert not (tmp_path / "no.mindrecord").exists()
