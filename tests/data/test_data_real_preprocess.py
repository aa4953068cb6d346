"""Preprocessing with a real model's tokenizer.json and chat template (SmolLM2), checked against
transformers: every row that fits equals ``apply_chat_template``'s ids, and its supervised tokens
decode to exactly the assistant answers (each with its ``<|im_end|>``); a template that refuses a
conversation is one error naming the file, the conversation and the template, exit 2, no output."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import DATA, REPO
from msllm.data.conversation import convert_alpaca_file, load_conversation_file
from msllm.data.mindrecord import read_mindrecord_arrays
from msllm.data.preprocess import preprocess_to_mindrecord

SEQ = 512
ROLES = {"human": "user", "gpt": "assistant"}


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory, smollm2_dir):
    d = tmp_path_factory.mktemp("smol_pre")
    conv = str(d / "conv.json")
    convert_alpaca_file(os.path.join(DATA, "alpaca_en_demo.json"), conv)
    out = str(d / "smol.mindrecord")
    summary = preprocess_to_mindrecord(conv, "qa", smollm2_dir, SEQ, out, shuffle=False, progress=False,
                                       template="chat_template", num_workers=2)
    return conv, out, summary


def test_rows_equal_apply_chat_template_and_labels_are_the_answers(preprocessed, smollm2_dir):
    from transformers import AutoTokenizer

    conv, out, summary = preprocessed
    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    convs = load_conversation_file(conv)
    arrays = read_mindrecord_arrays(out)
    ids_rows, label_rows = arrays["input_ids"], arrays["labels"]
    assert summary.skipped == {} and len(ids_rows) == len(convs) == 999
    checked = 0
    for turns, ids, labels in zip(convs, ids_rows, label_rows):
        messages = [{"role": ROLES[r], "content": t} for r, t in turns]
        ref = list(hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        if len(ref) > SEQ + 1:
            assert list(ids) == ref[:SEQ + 1]   # truncated rows keep the first seq_length + 1 tokens
            continue
        checked += 1
        assert list(ids[:len(ref)]) == ref and (ids[len(ref):] == 0).all()
        target = labels != -100
        assert (labels[target] == ids[target]).all()
        answers = [t for r, t in turns if r == "gpt"]
        assert hf.decode(ids[target]) == "".join(a + "<|im_end|>" for a in answers)
    assert checked > 900   # nearly every Alpaca record fits in 512 tokens
    meta = json.load(open(out + ".json"))
    assert meta["template"].startswith("chat_template:") and meta["tokenizer_kind"] == "tokenizer.json"
    assert meta["vocab_size"] == 49152 and meta["tokenizer_file"] == os.path.join(smollm2_dir, "tokenizer.json")


def test_a_conversation_the_template_refuses_is_one_error(tmp_path, smollm2_dir):
    import shutil

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(os.path.join(smollm2_dir, "tokenizer.json"), model)
    strict = ("{% for m in messages %}{% if 'forbidden' in m['content'] %}"
              "{{ raise_exception('no forbidden words') }}{% endif %}"
              "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": strict}))
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": "a forbidden question"}, {"from": "gpt", "value": "no"}]}]))
    out = tmp_path / "out.mindrecord"
    r = subprocess.run([sys.executable, os.path.join(REPO, "data_preprocess", "llama_preprocess.py"),
                        "--input_glob", str(conv), "--dataset_type", "qa", "--model_file", str(model),
                        "--seq_length", "32", "--output_file", str(out), "--no_progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    err = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(err) == 1, r.stderr
    assert f"{conv}: conversation 1: chat template chat_template:" in err[0] and "no forbidden words" in err[0]
    assert not list(tmp_path.glob("out.mindrecord*"))
