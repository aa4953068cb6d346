"""What every task module shares: document types, line-numbered file readers, few-shot prompts,
the per-subject CSV layout of MMLU and C-Eval.

Prompt assembly follows lm-evaluation-harness v0.4.13 ``ConfigurableTask.fewshot_context`` /
``build_qa_turn`` (``lm_eval/api/task.py``) for plain-text (no chat template) prompts:

    context = description + sum(example_question + target_delimiter + example_answer + fewshot_delimiter)
              + question
    continuation_i = target_delimiter + choice_i

with ``target_delimiter = " "`` and ``fewshot_delimiter = "\\n\\n"`` (the TaskConfig defaults).
Few-shot samplers: ``first_n`` (MMLU, C-Eval: the first n documents of the few-shot split, in
file order) and the default sampler (BoolQ, GSM8K: ``random.Random(1234).sample(pool, n)``
drawn once per evaluated document in document order; ``lm_eval/api/samplers.py``, seed 1234 is
``simple_evaluate``'s ``fewshot_random_seed``).
"""

from __future__ import annotations

import csv
import glob
import os
import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from msllm.data.conversation import json_lines
from msllm.errors import MsllmError

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
FEWSHOT_SEED = 1234
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass
class MCDoc:
    """A multiple-choice question ready to score.

    context: the whole prompt (description + few-shot examples + question); choices: the answer
    strings (``"A"``); continuations: what is scored after the context (``" A"``); gold: index of
    the right choice; where: ``file:line`` of the question; subject: the table row it counts in.
    """

    context: str
    choices: list
    gold: int
    where: str
    subject: str = ""

    @property
    def continuations(self) -> list:
        return [TARGET_DELIMITER + c for c in self.choices]


@dataclass
class GenDoc:
    """A generation question: ``context`` is the prompt, ``target`` the reference answer text."""

    context: str
    target: str
    where: str
    subject: str = ""


@dataclass
class TaskData:
    """A task's documents and how they are scored.

    kind: ``"mc"`` (log-likelihood of each choice; metrics ``acc`` and, where the harness reports
    it, ``acc_norm``) or ``"gen"`` (greedy generation until ``until``; exact match).
    per_subject: report a table by :attr:`MCDoc.subject`.
    """

    name: str
    kind: str
    docs: list
    metrics: tuple = ("acc",)
    num_fewshot: int = 0
    per_subject: bool = False
    until: tuple = ()
    files: list = field(default_factory=list)


def need_file(path: str, what: str) -> str:
    """``path`` if it is a file; else MsllmError naming it and what it should hold."""
    if not os.path.isfile(path):
        raise MsllmError(f"{path}: missing ({what})")
    return path


def read_csv(path: str, columns: int, header: Optional[Sequence[str]] = None) -> Iterator[tuple[int, list]]:
    """Rows of a CSV file as ``(line number, fields)``; the line is where the record starts.

    ``header``: the first row must name these columns (extra trailing columns allowed, e.g. C-Eval's
    ``explanation``); ``columns``: required number of fields (a header row allows ``len(header)``
    or more up to the header's length). Raises MsllmError naming the file and line.
    """
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh)
        line = 1
        width = columns
        try:
            for k, row in enumerate(reader):
                start, line = line, reader.line_num + 1
                if k == 0 and header is not None:
                    names = [c.strip().lstrip("\ufeff") for c in row]
                    if names[:len(header)] != list(header):
                        raise MsllmError(f"{path}:{start}: header {','.join(names)!r}: expected "
                                         f"{','.join(header)}[,...]")
                    width = len(names)
                    continue
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != width and not (header is not None and columns <= len(row) <= width):
                    raise MsllmError(f"{path}:{start}: {len(row)} columns, expected {width}"
                                     + (f" ({', '.join(header)})" if header else ""))
                yield start, row
        except csv.Error as exc:
            raise MsllmError(f"{path}:{line}: not valid CSV ({exc})") from None
        except UnicodeDecodeError as exc:
            raise MsllmError(f"{path}: not UTF-8 text ({exc})") from None


def read_jsonl(path: str, required: dict) -> Iterator[tuple[int, dict]]:
    """Records of a JSON-lines file as ``(line number, record)``; blank lines are skipped
    (:func:`msllm.data.conversation.json_lines`).

    ``required``: key -> type (or tuple of types) every record must have. Raises MsllmError naming
    the file and line for invalid JSON, a non-object, a missing key or a wrong type.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            for n, rec in json_lines(fh, path):
                if not isinstance(rec, dict):
                    raise MsllmError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
                for key, typ in required.items():
                    if key not in rec:
                        raise MsllmError(f"{path}:{n}: missing key {key!r} (expected {', '.join(required)})")
                    if not isinstance(rec[key], typ) or (typ is int and isinstance(rec[key], bool)):
                        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
                        raise MsllmError(f"{path}:{n}: {key!r} is {type(rec[key]).__name__}, expected {names}")
                yield n, rec
    except UnicodeDecodeError as exc:
        raise MsllmError(f"{path}: not UTF-8 text ({exc})") from None


def letter_index(value: str, n: int, where: str) -> int:
    """Index of answer letter ``value`` among the first ``n`` letters; MsllmError otherwise."""
    v = value.strip()
    if len(v) != 1 or v not in LETTERS[:n]:
        raise MsllmError(f"{where}: answer {value!r} is not one of {', '.join(LETTERS[:n])}")
    return LETTERS.index(v)


def fewshot_prefix(description: str, examples: Sequence[tuple[str, str]]) -> str:
    """``description`` followed by each (question, answer) example and the few-shot delimiter."""
    return description + "".join(q + TARGET_DELIMITER + a + FEWSHOT_DELIMITER for q, a in examples)


def first_n(pool: Sequence, n: int, where: str):
    """The harness's ``first_n`` sampler; MsllmError if the pool is too small."""
    if n > len(pool):
        raise MsllmError(f"{where}: {n}-shot asks for {n} examples but it holds {len(pool)}")
    return list(pool[:n])


class RandomSampler:
    """The harness's default sampler: one ``Random(seed)``, one draw per document in order.

    ``exclude_doc``: the harness passes the evaluated document to the sampler when the task's
    few-shot split equals its test split (for BoolQ both are unset, so it does): it then draws
    ``n + 1`` examples, drops those equal to the document and keeps the first ``n``
    (``ContextSampler.sample``). The draw sizes decide the random stream, so both are mirrored.
    """

    def __init__(self, pool: Sequence, where: str, seed: int = FEWSHOT_SEED, exclude_doc: bool = False):
        self.pool, self.where, self.rnd = list(pool), where, random.Random(seed)
        self.exclude_doc = exclude_doc

    def sample(self, n: int, doc=None) -> list:
        if n > len(self.pool):
            raise MsllmError(f"{self.where}: {n}-shot asks for {n} examples but it holds {len(self.pool)}")
        if n == 0:
            return []
        if not self.exclude_doc:
            return self.rnd.sample(self.pool, n)
        res = [x for x in self.rnd.sample(self.pool, min(n + 1, len(self.pool))) if x != doc][:n]
        if len(res) < n:
            res = self.rnd.sample([x for x in self.pool if x != doc], n)
        return res


def subjects(data_dir: str, split: str, benchmark: str) -> list[str]:
    """Subjects with a ``{split}/{subject}_{split}.csv`` file, sorted (MMLU's and C-Eval's
    released layout). Raises MsllmError if there is none."""
    files = sorted(glob.glob(os.path.join(data_dir, split, f"*_{split}.csv")))
    if not files:
        raise MsllmError(f"{os.path.join(data_dir, split)}: no {benchmark} {split} files (expected "
                         f"{split}/<subject>_{split}.csv, e.g. {split}/abstract_algebra_{split}.csv)")
    return [os.path.basename(f)[: -len(f"_{split}.csv")] for f in files]


def load_subject_csvs(data_dir: str, benchmark: str, split: str, k: int, limit: Optional[int],
                      read_split: Callable[[str], list], description: Callable[[str, str], str],
                      doc_to_text: Callable[[str, list], str], choices: Sequence[str]) -> tuple[list, list]:
    """The per-subject multiple-choice documents of a ``DATA_DIR/{dev,<split>}/{subject}_{split}.csv``
    benchmark (MMLU, C-Eval), as the harness builds them: per subject, ``description(subject, path
    of its split file)`` followed by the first ``k`` dev questions answered (``first_n``), then each
    of the first ``limit`` questions of ``split``.

    ``read_split(path)`` gives ``(question, options, gold index, file:line)`` rows; ``doc_to_text``
    the question's prompt. Returns ``(docs, files read)``: a list of :class:`MCDoc` and the paths in
    reading order. Raises MsllmError for no subject, a missing split file, too few dev questions for
    ``k``, an empty subject or no question at all (and whatever ``read_split`` raises).
    """
    docs, files = [], []
    for subject in subjects(data_dir, split, benchmark):
        path = need_file(os.path.join(data_dir, split, f"{subject}_{split}.csv"), f"{benchmark} {split} questions")
        prefix = description(subject, path)
        if k > 0:
            dev = need_file(os.path.join(data_dir, "dev", f"{subject}_dev.csv"),
                            f"{benchmark} dev questions: {k}-shot takes its examples from the dev split")
            shots = first_n(read_split(dev), k, dev)
            prefix = fewshot_prefix(prefix, [(doc_to_text(q, o), choices[g]) for q, o, g, _ in shots])
            files.append(dev)
        rows = limit_docs(read_split(path), limit)
        check_not_empty(rows, path)
        files.append(path)
        docs += [MCDoc(prefix + doc_to_text(q, o), list(choices), g, w, subject) for q, o, g, w in rows]
    check_not_empty(docs, data_dir)
    return docs, files


def limit_docs(docs: list, limit: Optional[int]) -> list:
    """The first ``limit`` documents (the harness's ``--limit``), all when None."""
    return docs if limit is None else docs[:limit]


def check_not_empty(docs: list, where: str) -> None:
    if not docs:
        raise MsllmError(f"{where}: no questions to evaluate (empty task)")
