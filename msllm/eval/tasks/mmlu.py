"""MMLU (Hendrycks et al., ICLR 2021) by log-likelihood, as lm-evaluation-harness v0.4.13's
``mmlu`` group (``lm_eval/tasks/mmlu/default/_default_template_yaml``, ``mmlu_<subject>.yaml``,
``_mmlu.yaml``):

* description ``"The following are multiple choice questions (with answers) about {subject}.\\n\\n"``
  (subject with ``_`` -> space);
* ``doc_to_text``: ``"{question.strip()}\\nA. {A}\\nB. {B}\\nC. {C}\\nD. {D}\\nAnswer:"``;
  choices ``A``..``D`` scored as ``" A"``..``" D"``;
* few-shot: the first n questions of the ``dev`` split (``sampler: first_n``), test split ``test``;
* metric ``acc``; the group's accuracy is micro-averaged over questions (``weight_by_size: True``).

Files: MMLU's released layout ``DATA_DIR/{dev,test}/{subject}_{split}.csv``, no header, columns
question, A, B, C, D, answer letter. Every ``test/*_test.csv`` is a subject.
"""

from __future__ import annotations

import glob
import os
from typing import Optional

from msllm.errors import MsllmError
from msllm.eval.tasks.common import (MCDoc, TaskData, check_not_empty, fewshot_prefix, first_n,
                                     letter_index, limit_docs, need_file, read_csv)

CHOICES = ["A", "B", "C", "D"]


def doc_to_text(question: str, options: list) -> str:
    """The harness's MMLU ``doc_to_text``."""
    return question.strip() + "".join(f"\n{c}. {o}" for c, o in zip(CHOICES, options)) + "\nAnswer:"


def description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def read_split(path: str) -> list[tuple[str, list, int, str]]:
    """(question, options, gold index, file:line) for every row of one MMLU CSV file."""
    out = []
    for line, row in read_csv(path, 6):
        where = f"{path}:{line}"
        out.append((row[0], row[1:5], letter_index(row[5], 4, where), where))
    return out


def subjects(data_dir: str, split: str = "test", benchmark: str = "MMLU") -> list[str]:
    """Subjects with a ``{split}/{subject}_{split}.csv`` file, sorted."""
    files = sorted(glob.glob(os.path.join(data_dir, split, f"*_{split}.csv")))
    if not files:
        raise MsllmError(f"{os.path.join(data_dir, split)}: no {benchmark} {split} files (expected "
                         f"{split}/<subject>_{split}.csv, e.g. {split}/abstract_algebra_{split}.csv)")
    return [os.path.basename(f)[: -len(f"_{split}.csv")] for f in files]


def load(data_dir: str, num_fewshot: Optional[int] = None, limit: Optional[int] = None) -> TaskData:
    """All subjects' questions with their prompts; ``limit``: first N questions per subject.

    Raises MsllmError for a missing split file, a malformed row (file:line), an answer outside
    A-D, too few dev questions for ``num_fewshot``, or no questions at all."""
    k = 0 if num_fewshot is None else num_fewshot
    docs, files = [], []
    for subject in subjects(data_dir):
        test = need_file(os.path.join(data_dir, "test", f"{subject}_test.csv"), "MMLU test questions")
        prefix = description(subject)
        if k > 0:
            dev = need_file(os.path.join(data_dir, "dev", f"{subject}_dev.csv"),
                            f"MMLU dev questions: {k}-shot takes its examples from the dev split")
            shots = first_n(read_split(dev), k, dev)
            prefix = fewshot_prefix(prefix, [(doc_to_text(q, o), CHOICES[g]) for q, o, g, _ in shots])
            files.append(dev)
        rows = limit_docs(read_split(test), limit)
        check_not_empty(rows, test)
        files.append(test)
        docs += [MCDoc(prefix + doc_to_text(q, o), list(CHOICES), g, w, subject) for q, o, g, w in rows]
    check_not_empty(docs, data_dir)
    return TaskData("mmlu", "mc", docs, ("acc",), k, per_subject=True, files=files)
