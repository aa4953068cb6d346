"""BoolQ (Clark et al., NAACL 2019) by log-likelihood, as lm-evaluation-harness v0.4.13's ``boolq``
(``lm_eval/tasks/super_glue/boolq/default.yaml``):

* ``doc_to_text``: ``"{passage}\\nQuestion: {question}?\\nAnswer:"``; choices ``no`` / ``yes``
  scored as ``" no"`` / ``" yes"``; gold ``yes`` when the answer is true;
* evaluated split: validation (BoolQ's ``dev.jsonl``); few-shot examples (default 0-shot) from
  ``train.jsonl`` with the harness's default random sampler (seed 1234, drawing n + 1 and
  dropping the evaluated document, as it does when no few-shot split is named); metric ``acc``.

Files: BoolQ's released JSON lines ``DATA_DIR/{train,dev}.jsonl``, records with ``question``
(str), ``passage`` (str), ``answer`` (bool); other keys (``title``) are ignored.
"""

from __future__ import annotations

import os
from typing import Optional

from msllm.eval.tasks.common import (MCDoc, RandomSampler, TaskData, check_not_empty, fewshot_prefix,
                                     limit_docs, need_file, read_jsonl)

CHOICES = ["no", "yes"]
FIELDS = {"question": str, "passage": str, "answer": bool}


def doc_to_text(rec: dict) -> str:
    return f"{rec['passage']}\nQuestion: {rec['question']}?\nAnswer:"


def read(path: str) -> list[tuple[dict, str]]:
    return [(rec, f"{path}:{n}") for n, rec in read_jsonl(path, FIELDS)]


def load(data_dir: str, num_fewshot: Optional[int] = None, limit: Optional[int] = None) -> TaskData:
    """The ``dev.jsonl`` questions with prompts. Raises MsllmError for a missing file, a bad
    record (file:line), too few training examples for ``num_fewshot``, or no questions."""
    k = 0 if num_fewshot is None else num_fewshot
    dev = need_file(os.path.join(data_dir, "dev.jsonl"), "BoolQ validation questions (dev.jsonl)")
    rows = limit_docs(read(dev), limit)
    check_not_empty(rows, dev)
    files = [dev]
    sampler = None
    if k > 0:
        train = need_file(os.path.join(data_dir, "train.jsonl"),
                          f"BoolQ training questions: {k}-shot takes its examples from train.jsonl")
        sampler = RandomSampler([r for r, _ in read(train)], train, exclude_doc=True)
        files.append(train)
    docs = []
    for rec, where in rows:
        shots = sampler.sample(k, rec) if sampler else []
        prefix = fewshot_prefix("", [(doc_to_text(s), CHOICES[int(s["answer"])]) for s in shots])
        docs.append(MCDoc(prefix + doc_to_text(rec), list(CHOICES), int(rec["answer"]), where, "boolq"))
    return TaskData("boolq", "mc", docs, ("acc",), k, files=files)
