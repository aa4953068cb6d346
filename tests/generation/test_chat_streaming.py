"""Chat streams its answer while it is produced, with the real SmolLM2 (byte-level BPE, its chat
template): text pieces arrive before the last decode step, none holds a broken character (Chinese
splits across tokens), they concatenate to the answer, and the answer equals transformers' greedy
answer to the same chat-template prompt."""

import os

import pytest

from gentest_helpers import ROOT


@pytest.fixture(scope="module")
def session(smollm2_dir):
    from msllm.config import load_config
    from msllm.generation.chat import open_chat

    cfg = load_config(os.path.join(ROOT, "configs", "smollm2", "run_smollm2_135m.yaml"),
                      [f"--load_checkpoint={smollm2_dir}", "--model.model_config.seq_length=256",
                       "--generation_config.max_new_tokens=24"])
    chat, info = open_chat(cfg)
    assert info.template.startswith("chat_template:")
    return chat


def test_answer_streams_before_the_end_without_broken_characters(session, smollm2_hf):
    steps, pieces = [], []
    generate = session.gen.generate

    def counting(prompts, settings, stream=None, **kw):
        def step(k, tokens, finished):
            steps.append(k)
            return stream(k, tokens, finished)
        return generate(prompts, settings, stream=step, **kw)

    session.gen.generate = counting
    try:
        reply = session.reply("用中文介绍一下北京。", on_text=lambda t: pieces.append((len(steps), t)))
    finally:
        session.gen.generate = generate
    assert len(pieces) > 3 and pieces[0][0] < len(steps) - 3      # printed while decoding went on
    assert all("\ufffd" not in t for _, t in pieces)
    assert "".join(t for _, t in pieces) == reply.text
    assert any(ord(c) > 0x4E00 for c in reply.text)                 # the answer really is Chinese

    hf, tok = smollm2_hf
    ids = tok.apply_chat_template([{"role": "user", "content": "用中文介绍一下北京。"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert reply.text == tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=True)
