"""Users' own multiple-choice sets in one simple JSON-lines form, scored like MMLU.

Record: ``{"question": str, "choices": [str, ...] (2 to 26), "answer": int index or letter}``;
optional ``"subject"`` (str) groups the per-subject table. Prompt (MMLU's ``doc_to_text`` with as
many letters as choices): ``"{question}\\nA. {c0}\\nB. {c1}...\\nAnswer:"``, choices scored as
``" A"``, ``" B"``, ...; metrics ``acc`` and ``acc_norm`` (the harness's length normalisation).

``DATA`` is a ``.jsonl`` file (0-shot), or a directory with ``test.jsonl`` and, for few-shot, the
examples in ``dev.jsonl`` (its first n, as MMLU's ``first_n``).
"""

from __future__ import annotations

import os
from typing import Optional

from msllm.errors import MsllmError
from msllm.eval.tasks.common import (LETTERS, MCDoc, TaskData, check_not_empty, fewshot_prefix, first_n,
                                     letter_index, limit_docs, need_file, read_jsonl)

FIELDS = {"question": str, "choices": list, "answer": (int, str)}


def doc_to_text(question: str, choices: list) -> str:
    return question.strip() + "".join(f"\n{LETTERS[i]}. {c}" for i, c in enumerate(choices)) + "\nAnswer:"


def read(path: str) -> list[tuple[str, list, int, str, str]]:
    """(question, choices, gold, subject, file:line) per record."""
    out = []
    for n, rec in read_jsonl(path, FIELDS):
        where = f"{path}:{n}"
        choices = rec["choices"]
        if not 2 <= len(choices) <= len(LETTERS) or not all(isinstance(c, str) for c in choices):
            raise MsllmError(f"{where}: 'choices' must be a list of 2 to 26 strings")
        answer = rec["answer"]
        if isinstance(answer, str):
            gold = letter_index(answer, len(choices), where)
        elif not 0 <= answer < len(choices):
            raise MsllmError(f"{where}: answer index {answer} is outside 0..{len(choices) - 1}")
        else:
            gold = answer
        out.append((rec["question"], choices, gold, str(rec.get("subject", "")), where))
    return out


def load(data: str, num_fewshot: Optional[int] = None, limit: Optional[int] = None) -> TaskData:
    """Questions with prompts; errors name the file and line."""
    k = 0 if num_fewshot is None else num_fewshot
    test = data if os.path.isfile(data) else need_file(os.path.join(data, "test.jsonl"),
                                                       "multiple-choice questions (test.jsonl)")
    files, prefix = [test], ""
    if k > 0:
        if os.path.isfile(data):
            raise MsllmError(f"{data}: --num_fewshot {k} needs a directory with test.jsonl and dev.jsonl")
        dev = need_file(os.path.join(data, "dev.jsonl"), f"{k}-shot examples (dev.jsonl)")
        shots = first_n(read(dev), k, dev)
        prefix = fewshot_prefix("", [(doc_to_text(q, c), LETTERS[g]) for q, c, g, _, _ in shots])
        files.append(dev)
    rows = limit_docs(read(test), limit)
    check_not_empty(rows, test)
    docs = [MCDoc(prefix + doc_to_text(q, c), list(LETTERS[:len(c)]), g, w, s) for q, c, g, s, w in rows]
    return TaskData("mc", "mc", docs, ("acc", "acc_norm"), k, per_subject=any(d.subject for d in docs),
                    files=files)
