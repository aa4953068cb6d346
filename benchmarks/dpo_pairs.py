"""Preference pairs made from the bundled Alpaca data (``examples/data/alpaca_en_demo.json``), for the DPO
held-out margin run (docs/dpo.md) and benchmarks/dpo_speed.py.

Each pair is a TRL conversational record: the prompt is an input-free Alpaca record's instruction, chosen =
that record's own answer, rejected = the next record's answer (an answer to another question: a preference
the model can learn and check on held-out prompts; as tests/training/dpo_trl_worker.py ``held_out_pairs``).
Only records whose instruction + answer are shorter than ``--max_chars`` characters are used (so a pair fits
a short ``seq_length``). The first ``--train`` pairs go to ``train.jsonl``; ``--held_out`` pairs from the end
of the file (disjoint records) to ``held_out.jsonl``.

    python benchmarks/dpo_pairs.py --out_dir /tmp/dpo --train 64 --held_out 16

Prints the two files and their pair counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pairs(records: list) -> list[dict]:
    """Records k, k+1 -> {prompt: k's instruction, chosen: k's answer, rejected: k+1's answer}."""
    return [{"prompt": [{"role": "user", "content": a["instruction"]}],
             "chosen": [{"role": "assistant", "content": a["output"]}],
             "rejected": [{"role": "assistant", "content": b["output"]}]} for a, b in zip(records, records[1:])]


def make(out_dir: str, n_train: int, n_held: int, max_chars: int = 400) -> dict:
    """Write ``train.jsonl`` and ``held_out.jsonl`` under ``out_dir``; returns their paths and counts.

    Raises ValueError: not enough short records for both sets without overlap."""
    with open(os.path.join(REPO, "examples", "data", "alpaca_en_demo.json"), encoding="utf-8") as fh:
        recs = [r for r in json.load(fh) if not r.get("input") and len(r["instruction"]) + len(r["output"]) < max_chars]
    if n_train + 1 + n_held + 1 > len(recs):
        raise ValueError(f"{len(recs)} Alpaca records shorter than {max_chars} characters: too few for {n_train} "
                         f"training and {n_held} held-out pairs")
    os.makedirs(out_dir, exist_ok=True)
    out = {}
    for name, chunk in (("train", recs[:n_train + 1]), ("held_out", recs[-(n_held + 1):])):
        path = os.path.join(out_dir, f"{name}.jsonl")
        rows = pairs(chunk)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(json.dumps(r) for r in rows) + "\n")
        out[name] = {"file": path, "pairs": len(rows)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", required=True)
    p.add_argument("--train", type=int, default=64)
    p.add_argument("--held_out", type=int, default=16)
    p.add_argument("--max_chars", type=int, default=400)
    a = p.parse_args()
    print(json.dumps(make(a.out_dir, a.train, a.held_out, a.max_chars), indent=1))


if __name__ == "__main__":
    main()
