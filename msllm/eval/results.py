"""Metrics from per-request scores, the printed summary and tables, the JSON results file.

Multiple choice (lm-evaluation-harness v0.4.13 ``ConfigurableTask.process_results``,
``lm_eval/api/task.py``): ``pred = argmax(loglikelihoods)`` (first on ties, ``np.argmax``),
``acc = pred == gold``; ``acc_norm`` uses ``loglikelihood / len(choice)`` with the length in
characters of the choice string (``completion_len``; for A-D choices it equals ``acc``). Task
and per-subject numbers are micro-averages over questions (MMLU's ``weight_by_size: True``).
Standard error: the harness's ``mean_stderr`` (sample standard deviation / sqrt(n)).
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict
from typing import Sequence

import numpy as np

from msllm.fileio import write_json_atomic


def stderr(values: Sequence[float]) -> float:
    n = len(values)
    if n < 2:
        return float("nan")
    return float(np.std(np.asarray(values, np.float64), ddof=1) / math.sqrt(n))


def mc_records(task, scores: dict, request_doc: Sequence[tuple[int, int]]) -> list[dict]:
    """One record per question: the loglikelihood and is_greedy of every choice, pred, metrics."""
    by_doc: dict = {}
    for qi, (d, c) in enumerate(request_doc):
        by_doc.setdefault(d, {})[c] = scores[qi]
    out = []
    for d, doc in enumerate(task.docs):
        lls = np.array([by_doc[d][c][0] for c in range(len(doc.choices))], np.float64)
        greedy = [bool(by_doc[d][c][1]) for c in range(len(doc.choices))]
        lengths = np.array([float(len(c)) for c in doc.choices])
        pred, pred_norm = int(np.argmax(lls)), int(np.argmax(lls / lengths))
        rec = {"doc": d, "where": doc.where, "subject": doc.subject, "gold": doc.gold, "pred": pred,
               "loglikelihoods": lls.tolist(), "is_greedy": greedy, "acc": float(pred == doc.gold)}
        if "acc_norm" in task.metrics:
            rec["acc_norm"] = float(pred_norm == doc.gold)
        out.append(rec)
    return out


def aggregate(records: Sequence[dict], metrics: Sequence[str]) -> dict:
    """``{metric: mean, metric_stderr: ..., "n": count}`` over ``records``."""
    out = {"n": len(records)}
    for m in metrics:
        vals = [r[m] for r in records]
        out[m] = float(np.mean(vals)) if vals else float("nan")
        out[f"{m}_stderr"] = stderr(vals)
    return out


def by_subject(records: Sequence[dict], metrics: Sequence[str]) -> "OrderedDict[str, dict]":
    groups: "OrderedDict[str, list]" = OrderedDict()
    for r in records:
        groups.setdefault(r["subject"], []).append(r)
    return OrderedDict((s, aggregate(rs, metrics)) for s, rs in groups.items())


def table(rows: "OrderedDict[str, dict]", metrics: Sequence[str], title: str = "subject") -> str:
    """A plain-text table: one line per subject with n and each metric in percent."""
    width = max([len(title)] + [len(s) for s in rows])
    head = f"{title:<{width}}  {'n':>5}  " + "  ".join(f"{m:>8}" for m in metrics)
    lines = [head, "-" * len(head)]
    for s, agg in rows.items():
        lines.append(f"{s:<{width}}  {agg['n']:>5}  " + "  ".join(f"{100 * agg[m]:>7.2f}%" for m in metrics))
    return "\n".join(lines)


def summary_line(task: str, agg: dict, metrics: Sequence[str], extra: str = "") -> str:
    """``mmlu: acc 25.31% (+- 1.20), n=1000, 5-shot`` style line."""
    parts = []
    for m in metrics:
        v, se = agg[m], agg.get(f"{m}_stderr", float("nan"))
        parts.append(f"{m} {100 * v:.2f}%" + ("" if math.isnan(se) else f" (+- {100 * se:.2f})"))
    return f"{task}: " + ", ".join(parts) + f", n={agg['n']}" + (f", {extra}" if extra else "")


def results_path(output_dir: str, task: str) -> str:
    """``output_dir/eval/results_{task}_{YYYYmmdd-HHMMSS}.json`` (a new file per run)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(os.path.abspath(output_dir), "eval", f"results_{task}_{stamp}.json")


def write_results(path: str, payload: dict) -> str:
    """Write the results JSON atomically (temporary name, then rename); returns the path."""
    write_json_atomic(path, payload)
    return path
