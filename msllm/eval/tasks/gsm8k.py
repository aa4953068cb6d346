"""GSM8K (Cobbe et al. 2021) by greedy generation, as lm-evaluation-harness v0.4.13's ``gsm8k``
(``lm_eval/tasks/gsm8k/gsm8k.yaml``):

* ``doc_to_text``: ``"Question: {question}\\nAnswer:"``; few-shot examples (default 5) are
  ``doc_to_text + " " + answer + "\\n\\n"`` drawn from ``train.jsonl`` by the default random sampler
  (seed 1234);
* greedy generation until ``"Question:"``, ``"</s>"``, ``"<|im_end|>"`` (and the tokenizer's EOS),
  at most 256 new tokens (HFLM's ``max_gen_toks``); the text is cut at the first stop string;
* two answers: ``strict-match`` (regex ``#### (\\-?[0-9\\.\\,]+)``, first match) and
  ``flexible-extract`` (regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)``, last match); each is compared with
  the reference after removing ``,``, ``$``, everything up to ``#### ``, a final ``.``, case
  folded (``exact_match`` with ``regexes_to_ignore``, ``lm_eval/api/metrics.py``).

Files: ``DATA_DIR/test.jsonl`` (and ``train.jsonl`` for few-shot), records ``question`` and
``answer`` (the solution, last line ``#### N``).
"""

from __future__ import annotations

import os
import re
from typing import Optional

from msllm.errors import MsllmError
from msllm.eval.tasks.common import (GenDoc, RandomSampler, TaskData, check_not_empty, fewshot_prefix,
                                     limit_docs, need_file, read_jsonl)

UNTIL = ("Question:", "</s>", "<|im_end|>")
MAX_GEN_TOKS = 256
FIELDS = {"question": str, "answer": str}
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORE = (",", "\\$", "(?s).*#### ", "\\.$")
FALLBACK = "[invalid]"


def doc_to_text(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def extract(text: str, regex: re.Pattern, group_select: int) -> str:
    """The harness's ``RegexFilter``: the ``group_select``-th match, first non-empty group, stripped."""
    found = regex.findall(text)
    if not found:
        return FALLBACK
    m = found[group_select]
    if isinstance(m, tuple):
        m = next((g for g in m if g), FALLBACK)
    return m.strip()


def normalise(text: str) -> str:
    for pattern in IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def score(generation: str, target: str) -> dict:
    """Extracted answers and exact match of one generation against the reference solution."""
    strict = extract(generation, STRICT, 0)
    flexible = extract(generation, FLEXIBLE, -1)
    gold = normalise(target)
    return {"strict": strict, "flexible": flexible,
            "exact_match,strict-match": float(normalise(strict) == gold),
            "exact_match,flexible-extract": float(normalise(flexible) == gold)}


def cut_at_stop(text: str, until) -> str:
    """The harness's ``postprocess_generated_text``: the text before each stop string in turn."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


def read(path: str) -> list[tuple[dict, str]]:
    out = []
    for n, rec in read_jsonl(path, FIELDS):
        if "####" not in rec["answer"]:
            raise MsllmError(f"{path}:{n}: 'answer' has no '#### N' final line (GSM8K's format)")
        out.append((rec, f"{path}:{n}"))
    return out


def load(data_dir: str, num_fewshot: Optional[int] = None, limit: Optional[int] = None) -> TaskData:
    """The ``test.jsonl`` questions with prompts (default 5-shot from ``train.jsonl``)."""
    k = 5 if num_fewshot is None else num_fewshot
    test = need_file(os.path.join(data_dir, "test.jsonl"), "GSM8K test questions (test.jsonl)")
    rows = limit_docs(read(test), limit)
    check_not_empty(rows, test)
    files, sampler = [test], None
    if k > 0:
        train = need_file(os.path.join(data_dir, "train.jsonl"),
                          f"GSM8K training questions: {k}-shot takes its examples from train.jsonl "
                          "(or pass --num_fewshot 0)")
        sampler = RandomSampler([r for r, _ in read(train)], train)
        files.append(train)
    docs = []
    for rec, where in rows:
        shots = sampler.sample(k) if sampler else []
        prefix = fewshot_prefix("", [(doc_to_text(s["question"]), s["answer"]) for s in shots])
        docs.append(GenDoc(prefix + doc_to_text(rec["question"]), rec["answer"], where, "gsm8k"))
    return TaskData("gsm8k", "gen", docs, ("exact_match,strict-match", "exact_match,flexible-extract"), k,
                    until=UNTIL, files=files)
