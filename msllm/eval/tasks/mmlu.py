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

from typing import Optional

from msllm.eval.tasks.common import TaskData, letter_index, load_subject_csvs, read_csv

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


def load(data_dir: str, num_fewshot: Optional[int] = None, limit: Optional[int] = None) -> TaskData:
    """All subjects' questions with their prompts; ``limit``: first N questions per subject.

    Raises MsllmError for a missing split file, a malformed row (file:line), an answer outside
    A-D, too few dev questions for ``num_fewshot``, or no questions at all."""
    k = 0 if num_fewshot is None else num_fewshot
    docs, files = load_subject_csvs(data_dir, "MMLU", "test", k, limit, read_split=read_split,
                                    description=lambda subject, _path: description(subject),
                                    doc_to_text=doc_to_text, choices=CHOICES)
    return TaskData("mmlu", "mc", docs, ("acc",), k, per_subject=True, files=files)
