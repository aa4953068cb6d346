"""Streaming text (``TextStream``, what chat prints token by token): the printed pieces never hold a
broken character and concatenate to the whole answer's decode, for byte-level BPE (SmolLM2's
tokenizer.json: Chinese and emoji split across tokens) and LLaMA's SentencePiece (leading spaces)."""

import pytest

from msllm.data.tokenizer import load_tokenizer
from msllm.generation.api import TextStream

TEXTS = [
    "北京是中国的首都，也是一座历史悠久的城市。",
    "Party time 🎉🚀👍🏽 — naïve café, Ελληνικά.",
    " Leading space, then\nnew lines\n\n  and indented code:\n    x = 1",
]


def stream_pieces(tok, ids, eos=()):
    stream = TextStream(tok, eos)
    return [stream.push(t) for t in ids], stream


@pytest.mark.parametrize("which", ["bpe", "sentencepiece"])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_decode_without_broken_characters(which, text, smollm2_dir, tokenizer_path):
    tok = load_tokenizer(smollm2_dir if which == "bpe" else tokenizer_path)
    ids = tok.encode(text)
    pieces, stream = stream_pieces(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == stream.text
    if which == "bpe":
        # byte-level BPE really splits characters here: some token alone decodes to a broken character
        assert any("\ufffd" in tok.decode([i]) for i in ids) == any(ord(c) > 0x7FF for c in text)


def test_text_arrives_before_the_end(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    ids = tok.encode(TEXTS[1])
    pieces, _ = stream_pieces(tok, ids)
    first = next(i for i, p in enumerate(pieces) if p)
    assert first < len(ids) // 2   # printed while the answer is still being produced


def test_end_of_turn_ids_are_not_printed(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    ids = tok.encode("Paris.") + [tok.eos_id]
    pieces, _ = stream_pieces(tok, ids, eos=(tok.eos_id,))
    assert "".join(pieces) == "Paris."
