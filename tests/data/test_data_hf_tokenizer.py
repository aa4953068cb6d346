"""The Hugging Face tokenizer and the model's own chat template, on the real SmolLM2 directory,
against transformers' ``AutoTokenizer`` and ``apply_chat_template`` (the independent reference)."""

import json
import os
import shutil

import pytest

from msllm.data.chat_template import ChatTemplate
from msllm.data.hf_tokenizer import HFTokenizer
from msllm.data.templates import IGNORE_INDEX, encode_segments, resolve_template
from msllm.data.tokenizer import load_tokenizer
from msllm.errors import MsllmError

TEXTS = [
    "The capital of France is Paris.",
    "北京是中国的首都，也是一座历史悠久的城市。",
    "def add(a, b):\n    return a + b  # sum\n\n\tprint(add(1, 2))",
    "Emoji: 🎉🚀👍🏽 and accents: naïve café, Ελληνικά, русский.",
    "  leading spaces, trailing spaces   \n\n",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
]
CONVERSATIONS = [
    [("human", "What is 2 + 2?"), ("gpt", "2 + 2 = 4.")],
    [("system", "You are terse."), ("human", "Name a colour."), ("gpt", "Blue."),
     ("human", "Another, in Chinese?"), ("gpt", "红色。")],
    [("human", "Write code."), ("gpt", "```python\nprint('hi')\n```")],
]


@pytest.fixture(scope="module")
def hf_tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def test_settings_from_the_model_directory(tok, hf_tok):
    assert isinstance(tok, HFTokenizer) and tok.kind == "tokenizer.json"
    assert tok.vocab_size == len(hf_tok) == 49152
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id)
    assert tok.pad_id == hf_tok.pad_token_id
    assert tok.eos_ids == (2,)
    assert tok.chat_template == hf_tok.chat_template
    # BOS is added exactly when AutoTokenizer adds it
    assert tok.add_bos == (hf_tok("hi")["input_ids"][0] == hf_tok.bos_token_id)


@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_encoding_equals_autotokenizer(tok, hf_tok, i):
    text = TEXTS[i]
    assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.encode_with_special(text) == hf_tok(text)["input_ids"]
    assert tok.decode(tok.encode(text)) == hf_tok.decode(hf_tok(text, add_special_tokens=False)["input_ids"],
                                                         skip_special_tokens=True)


def test_batch_encoding(tok, hf_tok):
    assert tok.encode_batch(TEXTS) == hf_tok(TEXTS, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_chat_template_ids_and_labels_equal_apply_chat_template(tok, hf_tok, i):
    turns = CONVERSATIONS[i]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    messages = [{"role": roles[r], "content": t} for r, t in turns]
    tmpl = resolve_template(None, tok)
    assert isinstance(tmpl, ChatTemplate)
    ids, labels = encode_segments(tok, tmpl.segments(turns))
    ref = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids == list(ref)
    # the supervised tokens decode to exactly the assistant turns, each closed by <|im_end|>
    spans, cur = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            assert lab == t
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    answers = [t for r, t in turns if r == "gpt"]
    assert [hf_tok.decode(s) for s in spans] == [a + "<|im_end|>" for a in answers]
    # the generation prompt equals transformers' with add_generation_prompt
    prompt = tok.encode_special(tmpl.prompt(turns[:-1]))
    assert prompt == list(hf_tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])


def test_template_name_records_its_digest(tok):
    tmpl = resolve_template(None, tok)
    assert tmpl.name.startswith("chat_template:") and len(tmpl.name) == len("chat_template:") + 12
    assert resolve_template(tmpl.name, tok).name == tmpl.name
    with pytest.raises(MsllmError, match="a different template"):
        resolve_template("chat_template:000000000000", tok)


def test_named_llama_templates_are_refused_for_this_tokenizer(tok):
    with pytest.raises(MsllmError, match="writes LLaMA's <s> / </s>"):
        resolve_template("vicuna_v1.1", tok)


def test_template_that_rejects_a_conversation(tok):
    bad = ChatTemplate("{{ raise_exception('roles must alternate') }}", tok)
    with pytest.raises(MsllmError, match="refused the conversation: roles must alternate"):
        bad.segments([("human", "a"), ("gpt", "b")])
    with pytest.raises(MsllmError, match="not a valid Jinja template"):
        ChatTemplate("{% for %}", tok)


def test_sandbox_blocks_python_internals(tok):
    evil = ChatTemplate("{{ messages.__class__.__mro__ }}", tok)
    with pytest.raises(MsllmError):
        evil.prompt([("human", "x")])


def test_bad_tokenizer_files(tmp_path, smollm2_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(MsllmError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MsllmError, match="has no tokenizer"):
        load_tokenizer(str(empty))
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    shutil.copy(os.path.join(smollm2_dir, "tokenizer.json"), cfg)
    (cfg / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not_a_token|>"}))
    with pytest.raises(MsllmError, match="eos_token '<|not_a_token|>' is not in the vocabulary"):
        load_tokenizer(str(cfg))
