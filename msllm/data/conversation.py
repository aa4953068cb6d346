"""Alpaca records -> conversation JSON, loading/validation of conversation JSON files, and the
JSON / JSON-lines readers the other input files share (:func:`load_json_file`, :func:`json_lines`).

Formats
-------
Alpaca (input of :func:`alpaca_to_conversation`): a JSON list of objects with string keys
``instruction`` and ``output`` and an optional ``input`` (Stanford Alpaca ``alpaca_data.json``).

Conversation JSON (output of the converter, input of ``llama_preprocess.py --dataset_type qa``),
the layout of MindFormers ``alpaca_converter.py`` (itself FastChat's ShareGPT layout)::

    [{"id": "1", "conversations": [{"from": "human", "value": PROMPT},
                                   {"from": "gpt", "value": OUTPUT}]}, ...]

``PROMPT`` is the Stanford Alpaca template (``train.py`` ``PROMPT_DICT``), see
:data:`PROMPT_INPUT` and :data:`PROMPT_NO_INPUT`.

Errors vs. skips
----------------
Anything that makes a file structurally unreadable (bad JSON, wrong top-level type, a record
that is not an object, a missing key, a non-string value) raises :class:`MsllmError` naming the
file, the record (index and id) and the key. Content that is well-formed but unusable for
training (an empty conversation, turns that do not alternate human/gpt) is *not* an error: the
preprocessor skips such records and reports the reason (see :func:`conversation_skip_reason`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Iterator

from msllm.errors import MsllmError

# Stanford Alpaca train.py PROMPT_DICT["prompt_input"] / ["prompt_no_input"], verbatim.
PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)

HUMAN = "human"
GPT = "gpt"

# Skip reasons reported by conversation_skip_reason (content problems, not structure errors).
SKIP_EMPTY = "empty conversation"
SKIP_NOT_ALTERNATING = "turns do not alternate human/gpt starting with human"
SKIP_NO_REPLY = "conversation ends with a human turn (no gpt reply)"


def load_json_file(path: str) -> Any:
    """Parse the UTF-8 JSON file at ``path`` and return the decoded Python object.

    Raises:
        MsllmError: the path is missing or a directory, the file is empty, not UTF-8, or not
            valid JSON (the message gives the file, line and column of the problem, which also
            catches a truncated file).
    """
    if not os.path.exists(path):
        raise MsllmError(f"{path}: file not found (expected a JSON file)")
    if os.path.isdir(path):
        raise MsllmError(f"{path}: is a directory (expected a JSON file)")
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as exc:
        raise MsllmError(f"{path}: not UTF-8 text at byte {exc.start} (expected a UTF-8 JSON file)") from None
    if not text.strip():
        raise MsllmError(f"{path}: file is empty (expected a JSON list of records)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # The decoder only reports "Unterminated string" when it hits the end of the input.
        at_end = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")
        hint = " (the file looks truncated)" if at_end else ""
        raise MsllmError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}{hint}"
        ) from None


def json_lines(lines: Iterable[str], path: str) -> Iterator[tuple[int, Any]]:
    """``(line number, decoded value)`` of every non-blank line of a JSON-lines file.

    ``lines``: the file's lines (an open text file or ``text.splitlines()``), numbered from 1;
    blank lines are skipped. The values may be any JSON type: callers check them.

    Raises:
        MsllmError: a line is not valid JSON (the message gives the file, line and column).
    """
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MsllmError(f"{path}: invalid JSON at line {n} column {exc.colno}: {exc.msg}") from None
        yield n, value


def _record_label(index: int, record: Any) -> str:
    """``record 3`` or ``record 3 (id '4')`` for messages; ``index`` is 0-based."""
    if isinstance(record, dict) and "id" in record:
        return f"record {index} (id {record['id']!r})"
    return f"record {index}"


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    """The Stanford Alpaca prompt for one record (``PROMPT_DICT`` of Stanford Alpaca train.py).

    Like Stanford's ``train.py``, the with-input template is used iff ``input_text != ""``.
    """
    if input_text != "":
        return PROMPT_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def alpaca_to_conversation(records: Any, source_name: str) -> list[dict]:
    """Convert decoded Alpaca records to the conversation layout (MindFormers alpaca_converter.py).

    Args:
        records: the decoded JSON top level; must be a list of objects with string
            ``instruction`` and ``output``; ``input`` is optional (missing or ``null`` means no
            input). Other keys are ignored.
        source_name: the file name used in error messages.

    Returns:
        ``[{"id": "1", "conversations": [{"from": "human", "value": prompt},
        {"from": "gpt", "value": output}]}, ...]`` with ids ``"1", "2", ...`` in input order.

    Raises:
        MsllmError: top level not a list, a record not an object, ``instruction``/``output``
            missing, or a field that is not a string (names the file, record index and key).
    """
    if not isinstance(records, list):
        raise MsllmError(
            f"{source_name}: top level is a JSON {type(records).__name__}, expected a list of "
            "Alpaca records (objects with instruction/input/output)"
        )
    out: list[dict] = []
    for index, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise MsllmError(
                f"{source_name}: record {index} is a JSON {type(rec).__name__}, expected an object "
                "with instruction/input/output"
            )
        for key in ("instruction", "output"):
            if key not in rec:
                raise MsllmError(f"{source_name}: record {index} has no {key!r} key (expected a string)")
        for key in ("instruction", "input", "output"):
            value = rec.get(key)
            if key == "input" and value is None:
                continue
            if not isinstance(value, str):
                raise MsllmError(
                    f"{source_name}: record {index} key {key!r} is a JSON {type(value).__name__}, "
                    "expected a string"
                )
        prompt = alpaca_prompt(rec["instruction"], rec.get("input") or "")
        out.append(
            {
                "id": str(index + 1),
                "conversations": [
                    {"from": HUMAN, "value": prompt},
                    {"from": GPT, "value": rec["output"]},
                ],
            }
        )
    return out


def convert_alpaca_file(data_path: str, output_path: str) -> dict:
    """Read an Alpaca JSON file, convert it, and write the conversation JSON atomically.

    Returns:
        A summary dict: ``records_read``, ``records_written``, ``with_input``, ``without_input``,
        ``output_path`` (absolute).

    Raises:
        MsllmError: see :func:`load_json_file` and :func:`alpaca_to_conversation`; also when the
            input holds no records. Nothing is written under ``output_path`` on error.
    """
    from msllm.fileio import write_json_atomic

    records = load_json_file(data_path)
    conversations = alpaca_to_conversation(records, data_path)
    if not conversations:
        raise MsllmError(f"{data_path}: the list holds no records (expected at least one Alpaca record)")
    write_json_atomic(output_path, conversations, indent=2)
    with_input = sum(1 for r in records if (r.get("input") or "") != "")
    return {
        "records_read": len(records),
        "records_written": len(conversations),
        "with_input": with_input,
        "without_input": len(records) - with_input,
        "output_path": os.path.abspath(output_path),
    }


def validate_conversation_records(records: Any, source_name: str) -> list[list[tuple[str, str]]]:
    """Check the structure of decoded conversation JSON and return each record's turns.

    Args:
        records: the decoded JSON top level (the converter's output layout, see module doc).
        source_name: the file name used in error messages.

    Returns:
        One list per record of ``(role, value)`` string pairs, in order. Roles are returned as
        written (not checked here: see :func:`conversation_skip_reason`).

    Raises:
        MsllmError (structure errors, naming file, record index/id and key): top level not a
            list; a record not an object or without a ``conversations`` list; a turn not an
            object; a turn's ``from`` or ``value`` missing or not a string.
    """
    if not isinstance(records, list):
        raise MsllmError(
            f"{source_name}: top level is a JSON {type(records).__name__}, expected a list of "
            'conversation records ({"id": ..., "conversations": [...]})'
        )
    result: list[list[tuple[str, str]]] = []
    for index, rec in enumerate(records):
        label = _record_label(index, rec)
        if not isinstance(rec, dict):
            raise MsllmError(
                f"{source_name}: {label} is a JSON {type(rec).__name__}, expected an object with "
                "a 'conversations' list"
            )
        if "conversations" not in rec:
            hint = (
                "; this looks like Alpaca data: convert it first with data_preprocess/alpaca_converter.py"
                if "instruction" in rec
                else ""
            )
            raise MsllmError(
                f"{source_name}: {label} has no 'conversations' key (expected a list of turns){hint}"
            )
        turns = rec["conversations"]
        if not isinstance(turns, list):
            raise MsllmError(
                f"{source_name}: {label} key 'conversations' is a JSON {type(turns).__name__}, "
                "expected a list of turns"
            )
        pairs: list[tuple[str, str]] = []
        for t_index, turn in enumerate(turns):
            where = f"{source_name}: {label} turn {t_index}"
            if not isinstance(turn, dict):
                raise MsllmError(
                    f"{where} is a JSON {type(turn).__name__}, expected an object with 'from' and 'value'"
                )
            for key in ("from", "value"):
                if key not in turn:
                    raise MsllmError(f"{where} has no {key!r} key (expected a string)")
                if not isinstance(turn[key], str):
                    raise MsllmError(
                        f"{where} key {key!r} is a JSON {type(turn[key]).__name__}, expected a string"
                    )
            pairs.append((turn["from"], turn["value"]))
        result.append(pairs)
    return result


def load_conversation_file(path: str) -> list[list[tuple[str, str]]]:
    """Load and structurally validate one conversation JSON file.

    Returns the turns of each record (see :func:`validate_conversation_records`).

    Raises:
        MsllmError: see :func:`load_json_file` and :func:`validate_conversation_records`.
    """
    return validate_conversation_records(load_json_file(path), path)


def conversation_skip_reason(turns: list[tuple[str, str]]) -> str | None:
    """Why a structurally valid conversation cannot become a training sample, or ``None``.

    A usable conversation is a non-empty list of (human, gpt) pairs: roles exactly
    ``human, gpt, human, gpt, ...`` ending with ``gpt``. Returns one of :data:`SKIP_EMPTY`,
    :data:`SKIP_NOT_ALTERNATING`, :data:`SKIP_NO_REPLY`.
    """
    if not turns:
        return SKIP_EMPTY
    for i, (role, _value) in enumerate(turns):
        if role != (HUMAN if i % 2 == 0 else GPT):
            return SKIP_NOT_ALTERNATING
    if len(turns) % 2 == 1:
        return SKIP_NO_REPLY
    return None
