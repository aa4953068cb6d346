"""The per-row token decision (msllm.generation.stepping), hand-checked with a character-level
tokenizer: stop strings across token boundaries, the held-back tail, EOS / length / stop
reasons, and the repetition penalty's memory of the prompt."""

import numpy as np

from msllm.config_generation import DecodeSettings
from msllm.generation.stepping import RowStep, StopText, held_back


class Chars:
    """id i <-> character chr(i) (ids 0 and 1 are EOS / pad and decode to nothing)."""

    vocab_size = 256

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i > 1)


def ids(text):
    return [ord(c) for c in text]


def test_held_back_is_the_longest_end_that_starts_a_stop_string():
    assert held_back("Hello <|im", ["<|im_end|>"]) == 4
    assert held_back("Hello <", ["<|im_end|>", "\n\nUser"]) == 1
    assert held_back("Hello\n\nUs", ["<|im_end|>", "\n\nUser"]) == 4
    assert held_back("Hello", ["<|im_end|>"]) == 0
    assert held_back("ab", ["abc", "b"]) == 2   # a whole stop string is the caller's business


def test_stop_text_cuts_before_a_stop_split_over_tokens_and_never_shows_it():
    st = StopText(Chars(), (0,), ["</s>", "###"])
    shown = []
    for tok in ids("Paris.</") + ids("s> more"):
        piece, stopped = st.push(tok)
        shown.append(piece)
        if stopped:
            break
    assert stopped and "".join(shown) == "Paris." and st.text == "Paris."
    assert all("<" not in p for p in shown)            # the held-back start never went out


def test_stop_text_gives_back_the_held_tail_when_the_row_ends_otherwise():
    st = StopText(Chars(), (0,), ["###"])
    out = "".join(st.push(t)[0] for t in ids("a ##"))
    assert out == "a "                                  # "##" could start "###": held back
    assert st.push(0) == ("", False)                    # EOS: no text
    assert st.finish() == "##" and st.text == "a ##"


def test_stop_found_only_in_the_new_tail_still_finds_every_stop():
    st = StopText(Chars(), (), ["xyz"])
    text = "a" * 500 + "xy"
    for t in ids(text):
        assert not st.push(t)[1]
    piece, stopped = st.push(ord("z"))
    assert stopped and st.text == "a" * 500


def test_row_step_reasons_and_penalty_memory():
    s = DecodeSettings(eos_token_id=(0,), pad_token_id=1)
    row = RowStep(s, max_new=3)
    assert row.accept(5) is None and row.accept(0) == "eos" and row.tokens == [5, 0]
    row = RowStep(s, max_new=2)
    assert row.accept(5) is None and row.accept(6) == "length"
    row.stop()
    assert row.reason == "stop"                         # a stop string in the last token wins
    pen = DecodeSettings(eos_token_id=(0,), pad_token_id=1, repetition_penalty=2.0)
    row = RowStep(pen, max_new=4, prompt=[3, 4])
    logits = np.zeros(8, np.float32)
    logits[3], logits[5] = 2.0, 1.5                     # token 3 seen in the prompt: 2.0 / 2 = 1.0 < 1.5
    assert row.choose(logits) == 5
    row.accept(5)
    assert list(row.seen) == [3, 4, 5]
