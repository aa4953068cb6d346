"""Perplexity of text files with a sliding window (Hugging Face's perplexity guide,
``transformers/docs/source/en/perplexity.md``: "Example: Calculating perplexity with GPT-2").

Documents: a ``.txt`` file is one document; a ``.jsonl`` file holds one document per record in its
``"text"`` field. Each document is tokenised as ``[BOS] + tokens`` (BOS is context, never
scored). Windows of at most ``max_length`` tokens start every ``stride`` tokens; window k scores
only the tokens after the previous window's end (the first window all but its first token), so
every token after BOS is scored exactly once, with up to ``max_length - stride`` tokens of
context carried over. ``stride == max_length``: disjoint windows.

The guide weights each window's mean loss by ``trg_len - 1`` tokens (``num_valid_tokens -
batch_size``); msllm sums the log-probabilities of exactly the tokens scored, so its mean is the
exact per-token mean over the document (the same as the guide when every window is full).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from msllm.errors import MsllmError
from msllm.eval.tasks.common import TaskData, check_not_empty, limit_docs, read_jsonl


@dataclass
class TextDoc:
    text: str
    where: str
    subject: str = ""


def windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, n_targets)`` per window over a sequence of ``n_tokens`` tokens, as the
    guide's loop makes them: the window is ``[begin, end)`` and its last ``n_targets`` tokens are
    scored (never the window's first token)."""
    if stride < 1 or stride > max_length:
        raise MsllmError(f"--stride {stride}: expected 1 <= stride <= max_length ({max_length})")
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        out.append((begin, end, min(end - prev_end, end - begin - 1)))
        prev_end = end
        if end == n_tokens:
            break
    return [w for w in out if w[2] > 0]


def load(path: str, num_fewshot: Optional[int] = None, limit: Optional[int] = None) -> TaskData:
    """Documents of a ``.txt`` or ``.jsonl`` file (``limit``: the first N JSONL records)."""
    if num_fewshot:
        raise MsllmError("task ppl takes no --num_fewshot")
    if not os.path.isfile(path):
        raise MsllmError(f"{path}: missing (task ppl reads a .txt file or a .jsonl file with a 'text' field)")
    if path.endswith(".jsonl"):
        docs = [TextDoc(rec["text"], f"{path}:{n}") for n, rec in read_jsonl(path, {"text": str})]
        docs = [d for d in docs if d.text.strip()]
    else:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError as exc:
            raise MsllmError(f"{path}: not UTF-8 text ({exc})") from None
        docs = [TextDoc(text, path)] if text.strip() else []
    docs = limit_docs(docs, limit)
    check_not_empty(docs, path)
    return TaskData("ppl", "ppl", docs, ("nll", "ppl"), 0, files=[path])
