"""``tools/chat.py`` through its command line: ``--prompt`` answers one message with HF's greedy
continuation of the checkpoint's template prompt; the interactive loop streams answers, keeps the
history (the second answer continues the conversation), drops the oldest turns with a notice when
the context window is full, and ``/reset`` / ``/exit`` work."""

import os
import subprocess
import sys

import pytest

from gentest_helpers import ROOT, converted_model, hf_generate, hf_new_tokens
from msllm.data.templates import encode_prompt, get_template

SEED = 61
HF_KW = dict(vocab_size=32000, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=128)
NEW = 8
CHAT = os.path.join(ROOT, "tools", "chat.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return converted_model(tmp_path_factory.mktemp("chat_model"), SEED, HF_KW, {"max_new_tokens": NEW})


def answer(hf_model, tokenizer, turns):
    """HF greedy answer (text, EOS dropped) to ``turns`` under the vicuna_v1.1 template."""
    ids = encode_prompt(tokenizer, get_template("vicuna_v1.1"), turns)
    out, length = hf_generate(hf_model, [ids], max_new_tokens=NEW, do_sample=False)
    toks = hf_new_tokens(out, length)[0]
    toks = toks[:toks.index(2)] if 2 in toks else toks
    return tokenizer.decode(toks)


def chat(model, *args, stdin=None):
    return subprocess.run([sys.executable, CHAT, "--config", model["yaml"], "--load_checkpoint", model["ckpt"],
                           *args], input=stdin, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, GLOG_v="3"))


def test_prompt_mode_answers_one_message(model, tokenizer):
    r = chat(model, "--prompt", "What is the capital of France?")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == answer(model["hf"], tokenizer, [("human", "What is the capital of France?")]) + "\n"
    assert "template 'vicuna_v1.1'" in r.stderr


def test_interactive_history_window_reset_and_exit(model, tokenizer):
    long = "Tell me everything about the history of the city of Rome and its emperors, please."
    r = chat(model, stdin=f"Hi\nHow are you?\n{long}\n{long}\n/reset\nHow are you?\n/exit\nnever read\n")
    assert r.returncode == 0, r.stderr[-3000:]
    got = [a.split("\nuser> ")[0] for a in r.stdout.split("assistant> ")[1:]]
    assert len(got) == 5, r.stdout
    a1 = answer(model["hf"], tokenizer, [("human", "Hi")])
    assert got[0] == a1
    # the second answer continues the conversation: the first pair is in its prompt
    assert got[1] == answer(model["hf"], tokenizer, [("human", "Hi"), ("gpt", a1), ("human", "How are you?")])
    # 128 positions - 8 new tokens: the fourth message no longer fits after three pairs
    assert "[history: dropped the" in r.stderr
    # after /reset the same question is answered as a first message
    assert got[4] == answer(model["hf"], tokenizer, [("human", "How are you?")])
    assert "[history cleared]" in r.stderr


def test_unknown_template_is_one_error(model):
    r = chat(model, "--template", "chatml2", "--prompt", "hi")
    assert r.returncode == 2
    assert [x for x in r.stderr.splitlines() if x.startswith("error: ")] == [
        "error: unknown prompt template 'chatml2'; expected one of vicuna_v1.1, alpaca, none, chat_template, chatml"]
