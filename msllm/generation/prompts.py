"""What to generate from: ``--predict_data`` (a prompt or a file of them) and prompt templates.

``--predict_data`` is read as a file when it names an existing file, or when it looks like a
file name (one word ending in ``.txt`` / ``.json`` / ``.jsonl``: then a missing file is an
error rather than a prompt); otherwise it is the prompt text itself.

File formats (each record gives one conversation that ends with a user turn):

* ``.txt``: one prompt per line (blank lines are skipped);
* ``.json``: a list of records; ``.jsonl``: one record per line (blank lines skipped);
* a record is a string (the prompt), ``{"prompt": str}``, an Alpaca record
  ``{"instruction": str, "input": str (optional)}`` (made into the Stanford Alpaca prompt exactly
  as ``alpaca_converter`` does for training, :func:`msllm.data.conversation.alpaca_prompt`), or a
  conversation record of ``alpaca_converter``'s output ``{"conversations": [{"from": "human" |
  "gpt", "value": str}, ...]}`` (turns alternate starting with ``human``; a final ``gpt`` turn is
  the reference answer: it is kept as ``reference`` and the model answers the turn before), or
  a chat record ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``
  (the same rules; an optional first system message, which needs a chat template).

Turns become token ids through the prompt template (:mod:`msllm.data.templates`,
``encode_prompt``); without a template (``None``, e.g. a checkpoint converted from HF) a
conversation is plain text in the layout of the ``none`` template: ``[bos] + user`` then
``answer + [eos]`` per turn pair, so a single prompt is ``[bos] + tokenize(text)``, the ids
``transformers``' ``LlamaTokenizer`` gives.

Errors (:class:`MsllmError`, one message naming the file, line or record and what was
expected): a missing, empty or malformed file, a record of an unknown shape, an unknown template.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from msllm.data.conversation import GPT, HUMAN, alpaca_prompt, json_lines, load_json_file

SYSTEM = "system"
from msllm.errors import MsllmError

FILE_SUFFIXES = (".txt", ".json", ".jsonl")


@dataclass
class PromptRecord:
    """One input: ``turns`` [(role, text), ...] alternating ``human``/``gpt`` and ending with a
    ``human`` turn; ``reference``: the answer the record carried, if any; ``index``: 0-based
    position in the input."""

    index: int
    turns: list
    reference: Optional[str] = None

    @property
    def text(self) -> str:
        """The last user turn (what the model answers)."""
        return self.turns[-1][1]


def looks_like_file(value: str) -> bool:
    return os.path.isfile(value) or (value.strip() == value and " " not in value and "\n" not in value
                                     and value.lower().endswith(FILE_SUFFIXES))


def _record(value, index: int, where: str) -> PromptRecord:
    label = f"{where}: record {index}"
    if isinstance(value, str):
        return PromptRecord(index, [(HUMAN, value)])
    if not isinstance(value, dict):
        raise MsllmError(f"{label}: expected a string or an object, got {type(value).__name__}")
    if "prompt" in value:
        if not isinstance(value["prompt"], str):
            raise MsllmError(f"{label}: \"prompt\" must be a string")
        return PromptRecord(index, [(HUMAN, value["prompt"])])
    if "instruction" in value:
        ins, inp = value["instruction"], value.get("input", "")
        inp = "" if inp is None else inp
        if not isinstance(ins, str) or not isinstance(inp, str):
            raise MsllmError(f"{label}: Alpaca \"instruction\" and \"input\" must be strings")
        ref = value.get("output")
        return PromptRecord(index, [(HUMAN, alpaca_prompt(ins, inp))], ref if isinstance(ref, str) else None)
    if "messages" in value:
        return _messages_record(value["messages"], index, label)
    if "conversations" in value:
        conv = value["conversations"]
        if not isinstance(conv, list) or not conv:
            raise MsllmError(f"{label}: \"conversations\" must be a non-empty list of turns")
        turns = []
        for t, turn in enumerate(conv):
            if (not isinstance(turn, dict) or turn.get("from") not in (HUMAN, GPT)
                    or not isinstance(turn.get("value"), str)):
                raise MsllmError(f"{label}: turn {t} must be {{\"from\": \"human\"|\"gpt\", \"value\": str}}")
            want = HUMAN if t % 2 == 0 else GPT
            if turn["from"] != want:
                raise MsllmError(f"{label}: turn {t} is from {turn['from']!r}, expected {want!r} (turns alternate "
                                 "human/gpt starting with human)")
            turns.append((turn["from"], turn["value"]))
        reference = None
        if turns[-1][0] == GPT:
            reference = turns.pop()[1]
        return PromptRecord(index, turns, reference)
    raise MsllmError(f"{label}: unknown record; expected a string, {{\"prompt\": ...}}, an Alpaca record "
                     "{\"instruction\": ..., \"input\": ...} or {\"conversations\": [...]}")


def _messages_record(messages, index: int, label: str) -> PromptRecord:
    """An OpenAI / HF chat record ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}]}``:
    an optional leading system turn, then user/assistant alternating; a final assistant turn is the
    reference answer."""
    roles = {"system": SYSTEM, "user": HUMAN, "assistant": GPT}
    if not isinstance(messages, list) or not messages:
        raise MsllmError(f"{label}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    turns = []
    for t, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise MsllmError(f"{label}: message {t} must be {{\"role\": \"system\"|\"user\"|\"assistant\", "
                             "\"content\": str}")
        if m["role"] == "system" and t != 0:
            raise MsllmError(f"{label}: message {t} is a system message; only the first message may be one")
        turns.append((roles[m["role"]], m["content"]))
    body = turns[1:] if turns[0][0] == SYSTEM else turns
    for t, (role, _) in enumerate(body):
        if role != (HUMAN if t % 2 == 0 else GPT):
            raise MsllmError(f"{label}: messages must alternate user/assistant starting with user (after an "
                             "optional system message)")
    reference = turns.pop()[1] if turns[-1][0] == GPT else None
    if not turns or turns[-1][0] != HUMAN:
        raise MsllmError(f"{label}: expected a user message to answer")
    return PromptRecord(index, turns, reference)


def read_prompt_file(path: str) -> list[PromptRecord]:
    """The records of a ``.txt`` / ``.json`` / ``.jsonl`` prompts file (module doc).

    Raises MsllmError: missing or empty file, unknown suffix, malformed JSON (with line), a bad
    record (with its index), no prompt at all."""
    if not os.path.exists(path):
        raise MsllmError(f"--predict_data {path}: file not found")
    if os.path.isdir(path):
        raise MsllmError(f"--predict_data {path}: is a directory (expected a .txt, .json or .jsonl file)")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FILE_SUFFIXES:
        raise MsllmError(f"--predict_data {path}: unknown file type {suffix!r}; expected .txt (one prompt per "
                         "line), .json (a list of records) or .jsonl (one record per line)")
    if suffix == ".json":
        data = load_json_file(path)
        if not isinstance(data, list):
            raise MsllmError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        records = [_record(v, i, path) for i, v in enumerate(data)]
    else:
        try:
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except UnicodeDecodeError as exc:
            raise MsllmError(f"{path}: not UTF-8 text at byte {exc.start}") from None
        if suffix == ".txt":
            records = [PromptRecord(i, [(HUMAN, line)]) for i, line in enumerate(x for x in lines if x.strip())]
        else:
            records = [_record(value, i, f"{path} line {n}") for i, (n, value) in enumerate(json_lines(lines, path))]
    if not records:
        raise MsllmError(f"{path}: no prompts in the file (it is empty)")
    return records


def read_predict_data(value: Optional[str]) -> tuple[list[PromptRecord], bool]:
    """(records, from_file) for ``--predict_data`` (module doc). Raises MsllmError if it is
    missing or empty, or for a bad file."""
    if value is None or not value.strip():
        raise MsllmError("run_mode predict needs --predict_data: a prompt (\"I love Beijing, because\") or a "
                         ".txt / .json / .jsonl file of prompts")
    if looks_like_file(value):
        return read_prompt_file(value), True
    return [PromptRecord(0, [(HUMAN, value)])], False


# ---------------------------------------------------------------------------------------------
# Templates


def check_template(name: Optional[str]) -> None:
    """MsllmError for an unknown template name (before a model is loaded)."""
    from msllm.data.templates import check_template_name

    check_template_name(name)


def template_for(name: Optional[str], tokenizer):
    """The template to prompt with: ``name`` (``--template`` or the one recorded with the
    checkpoint) resolved against ``tokenizer``, else the tokenizer's own chat template, else None
    (plain text). ``none`` with a ``tokenizer.json`` is plain text (its BOS rule, no template
    text). Raises MsllmError as :func:`msllm.data.templates.resolve_template`."""
    from msllm.data.templates import resolve_template

    if name == "none" and tokenizer.kind != "sentencepiece":
        return None
    return resolve_template(name, tokenizer)


def encode_turns(tokenizer, template, turns) -> list[int]:
    """Token ids of a conversation ``turns`` (ending with a user turn) ready for the model to
    answer: ``msllm.data.templates.encode_prompt`` with a template, else plain (module doc:
    each user turn starts with BOS when the tokenizer adds one)."""
    if template is not None:
        from msllm.data.templates import encode_prompt

        return list(encode_prompt(tokenizer, template, turns))
    ids: list[int] = []
    for role, text in turns:
        if role == HUMAN:
            ids += tokenizer.encode_with_special(text)
        elif role == GPT:
            ids += tokenizer.encode(text) + [tokenizer.eos_id]
        else:
            raise MsllmError(f"a {role!r} turn needs a chat template (plain prompts have user and assistant turns)")
    return ids


def stop_strings(template) -> tuple:
    """Strings that end an answer under ``template`` (its ``stop_strings``; none for plain text)."""
    return tuple(getattr(template, "stop_strings", ()) or ()) if template is not None else ()


def cut_at_stop(text: str, stops) -> tuple[str, bool]:
    """``text`` up to the first of ``stops`` (and whether one was found)."""
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
