"""Preprocessing speed on the trainer-sized input: msllm's ``data_preprocess/llama_preprocess.py``
on the bundled Alpaca records, 1 and 2 workers, as a user runs it before ``run_msllm.py``.

Input: examples/data/alpaca_en_demo.json (999 records) converted by
``data_preprocess/alpaca_converter.py`` into conversation JSON (``common.alpaca_conversation``),
and copies of it repeated ``--copies`` times (default 1 and 10: 999 and 9,990 conversations, ids
made unique), ``--dataset_type qa``, the LLaMA tokenizer (examples/data/tokenizer.model),
``--seq_length 256`` (configs/llama/run_llama_tiny.yaml's). Runs alternate: for each round, for
each input, 1 worker then 2 workers (benchmarks/preprocess_speed.py's ``run_pair``).

    .venv/bin/python benchmarks/preprocess_alpaca.py [--rounds 3] [--copies 1,10] [--seq_length 256]

Reports per (input, workers), median and range over the rounds: the command's wall time
(interpreter start to exit), and from the summary the command prints, its tokenize, MindSpore
import and write seconds, and tokenize records/s (records / tokenize seconds). Checks that the 1-
and 2-worker outputs are byte-identical. Every run records the load average before it (the
machine's other jobs slow the wall times). Writes benchmarks/results/preprocess_alpaca.json.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness
import preprocess_speed


def conversation_copies(copies: int) -> str:
    """The converted Alpaca conversations repeated ``copies`` times (ids ``{id}-{k}``), once."""
    src = common.alpaca_conversation()
    if copies == 1:
        return src
    out = os.path.join(common.CACHE, f"alpaca-conversation-x{copies}.json")
    if not os.path.exists(out):
        with open(src, encoding="utf-8") as fh:
            conv = json.load(fh)
        harness.write_json(out, [dict(c, id=f"{c['id']}-{k}") for k in range(copies) for c in conv])
    return out


def summarise(runs: list[dict]) -> dict:
    table = {}
    for key in dict.fromkeys((r["copies"], r["workers"]) for r in runs):
        rs = [r for r in runs if (r["copies"], r["workers"]) == key]
        row = {"copies": key[0], "workers": key[1], "records": rs[0]["records"], "rows": rs[0]["rows"],
               "tokens": rs[0]["tokens"], "runs": len(rs), "loads": [r["load"] for r in rs]}
        for field in ("wall_s", "tokenize_s", "import_s", "write_s", "internal_total_s"):
            vals = [r[field] for r in rs]
            row[field] = {"median": common.median(vals), "min": min(vals), "max": max(vals)}
        rate = [r["records"] / r["tokenize_s"] for r in rs]
        row["tokenize_records_per_s"] = {"median": common.median(rate), "min": min(rate), "max": max(rate)}
        table[f"x{key[0]}/w{key[1]}"] = row
    return table


def markdown(table: dict) -> str:
    def span(v, fmt):
        return f"{v['median']:{fmt}} ({v['min']:{fmt}}-{v['max']:{fmt}})"

    lines = ["| input | workers | records | rows | command wall s | tokenize s | tokenize records/s "
             "| MindSpore import s | write s | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in table.values():
        lines.append(f"| {row['copies']}x Alpaca | {row['workers']} | {row['records']:.0f} | {row['rows']:.0f} "
                     f"| {span(row['wall_s'], '.2f')} | {span(row['tokenize_s'], '.2f')} "
                     f"| {span(row['tokenize_records_per_s'], '.0f')} | {span(row['import_s'], '.2f')} "
                     f"| {span(row['write_s'], '.2f')} | {', '.join(x.split()[0] for x in row['loads'])} |")
    return "\n".join(lines)


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--copies", default="1,10", help="input sizes: the conversations repeated N times")
    p.add_argument("--seq_length", type=int, default=256)
    p.add_argument("--out", default=os.path.join(common.HERE, "results", "preprocess_alpaca.json"))
    a = p.parse_args(argv)
    t0 = time.time()
    info = common.machine()
    print(f"# {info}", flush=True)
    copies = [int(c) for c in a.copies.split(",")]
    inputs = {c: conversation_copies(c) for c in copies}
    runs, identical = [], []
    with tempfile.TemporaryDirectory(prefix="prep_alpaca_") as tmp:
        for rnd in range(a.rounds):
            for c in copies:
                pair, same = preprocess_speed.run_pair(inputs[c], tmp, f"round {rnd} x{c}", a.seq_length, "alpaca")
                runs += [dict(r, round=rnd, copies=c) for r in pair]
                identical.append({"round": rnd, "copies": c, "identical": same})
    table = summarise(runs)
    result = {"machine": info, "command": harness.command_line(), "seq_length": a.seq_length,
              "inputs": {f"x{c}": os.path.relpath(path, common.ROOT) for c, path in inputs.items()},
              "outputs_identical_1_vs_2_workers": identical, "table": table, "runs": runs}
    harness.finish(a.out, result, markdown(table), t0)


if __name__ == "__main__":
    main()
