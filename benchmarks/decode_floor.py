"""Batch-1 decoding's memory floor on this machine: the bytes a decoded token must read (every
weight once, plus the cached keys and values it attends to) over the machine's measured
streaming-read bandwidth, and the share of that floor each framework's measured decode step
reaches (floor ms / step ms, from a ``benchmarks/decode_speed.py`` result file).

Bandwidth: the best of ``--rounds`` alternating measurements of two independent readers of one
1 GiB float32 matrix W (65536 x 4096), neither msllm's: torch's ``mv`` (W x, 2 threads: each
weight read once, the decoding access pattern) and numpy's ``W.sum()`` (one thread). Bytes per
token for SmolLM2-135M-Instruct (30 layers, hidden 576, 9 / 3 heads of 64, FFN 1536, vocab
49152, tied head): the linear weights and the head table (float32: 4 bytes, bfloat16: 2, weight-only
int8 per output channel: 1 plus a 4-byte scale per output row, :func:`weight_bytes`; llama.cpp's
Q8_0 for comparison: 34 bytes per block of 32) plus 2 x layers x kv heads x head_dim x 4 bytes per
cached slot, at the mean slot count of the benchmark's decode steps (prompt + new / 2).

    .venv/bin/python benchmarks/decode_floor.py --decode benchmarks/results/decode_speed_smollm2_amd_zen4.json
        [--out benchmarks/results/decode_floor_smollm2_amd_zen4.json]
    .venv/bin/python benchmarks/decode_floor.py --llamacpp benchmarks/results/llamacpp_speed_*<machine>.json
        --out benchmarks/results/decode_floor_llamacpp_<machine>.json   # both frameworks, every precision
        [--bandwidth_file benchmarks/results/weight_stream_bandwidth_<machine>.json]

With ``--bandwidth_file`` the best variant of ``weight_stream_bandwidth.py`` (SmolLM2's float32 weight set read by
matrix-vector products of its own, 2 threads) is a third reader, and the floor is at the fastest of the three: on
AMD EPYC machines torch's ``mv`` read 20-23 GB/s where that benchmark read 32-33, and both frameworks' float32
steps came out "above the floor".

A ``--llamacpp`` file run with ``--bandwidth_probe`` also holds, for every precision's pair in every round, that
benchmark's fastest variant run just before and just after the pair (``weight_stream_bandwidth.probe``). This
machine's read rate moves by up to 20% from one minute to the next (AMD EPYC Zen 5 guest, session 25), so a step
measured in a slow minute against a bandwidth measured in a fast one understates the share, and the reverse
overstates it. ``batch1_same_minute`` therefore divides each round's step by the floor at the mean of its two probes'
best passes (the statistic of ``gb_s_median_of_best_pass`` above) and gives the median (min-max) over rounds, and the
same with their median passes.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402
import ratios  # noqa: E402

SMOLLM2 = dict(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152)


def weight_params(m: dict) -> int:
    c, d = m["hidden"], m["head_dim"]
    per_layer = c * m["heads"] * d * 2 + c * m["kv_heads"] * d * 2 + 3 * c * m["ffn"]
    return m["layers"] * per_layer + m["vocab"] * c           # + the (tied) output head's table


def output_rows(m: dict) -> int:
    """Output rows of every matrix a token multiplies by (one int8 scale each, per output channel)."""
    d = m["head_dim"]
    per_layer = m["heads"] * d + 2 * m["kv_heads"] * d + m["hidden"] + 2 * m["ffn"] + m["hidden"]
    return m["layers"] * per_layer + m["vocab"]


def weight_bytes(m: dict, storage: str) -> float:
    """Bytes of the weights a decoded token reads: ``fp32``, ``bf16``, ``int8`` (msllm's weight-only
    int8 per output channel: 1 byte a weight + a float32 scale per output row) or ``q8_0`` (llama.cpp's
    Q8_0: blocks of 32 int8 weights with one fp16 scale, 34 bytes; ``ggml-common.h`` ``block_q8_0``)."""
    n = weight_params(m)
    return {"fp32": 4.0 * n, "bf16": 2.0 * n, "int8": n + 4.0 * output_rows(m), "q8_0": n * 34 / 32}[storage]


def storage_of(framework: str) -> str:
    return "bf16" if framework.endswith("bf16") else "int8" if framework.endswith("int8") else "fp32"


def bytes_per_token(m: dict, storage: str, slots: float, cache_bytes: int = 4) -> float:
    """Weights plus the cached keys and values of ``slots`` positions at ``cache_bytes`` per element
    (msllm's cache is float32: 4; llama.cpp's default ``-ctk f16 -ctv f16``: 2)."""
    cache = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * cache_bytes * slots
    return weight_bytes(m, storage) + cache


# llamacpp_speed.py's precision -> (msllm's weight storage, llama.cpp's GGUF storage)
# (bf16c: msllm's bf16 weights with compute_dtype bfloat16, the same bytes per token as bf16)
LLAMACPP_STORAGE = {"f32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "bf16c": ("bf16", "bf16"), "int8": ("int8", "q8_0")}


def batch1_steps(a) -> tuple[dict, float]:
    """({row name: (weight storage, cache bytes per element, measured ms per decode step)}, mean cached
    slots) at batch 1, from a ``decode_speed.py`` file (``--decode``) or a ``llamacpp_speed.py`` file
    (``--llamacpp``: both frameworks at each precision, step = 1 / decode tokens/s)."""
    if a.decode:
        dec = json.load(open(a.decode))
        slots = dec["settings"]["prompt"] + dec["settings"]["new"] / 2
        return {name: (storage_of(name), 4, r["decode_step_ms"])
                for name, r in dec["summary"].get("smollm2/b1", {}).items() if "decode_step_ms" in r}, slots
    rows, slots = {}, set()
    for path in a.llamacpp:
        run = json.load(open(path))
        slots.add(run["settings"]["prompt"] + run["settings"]["new"] / 2)
        for key, r in run["summary"].items():
            precision, batch = key.split("/")
            if batch != "b1":
                continue
            ours, theirs = LLAMACPP_STORAGE[precision]
            rows[f"msllm {precision}"] = (ours, 4, 1e3 / r["msllm"]["decode_tokens_per_s"])
            rows[f"llama.cpp {precision}"] = (theirs, 2, 1e3 / r["llama.cpp"]["decode_tokens_per_s"])
    if len(slots) != 1:
        raise SystemExit(f"--llamacpp files with different prompt / new token settings: {sorted(slots)}")
    return rows, slots.pop()


def same_minute(paths: list[str]) -> dict:
    """{"<framework> <precision>": per-round shares of the floor at batch 1} from ``llamacpp_speed.py
    --bandwidth_probe`` files: each round's step (1 / decode tokens/s) against the floor at the bandwidth probed around
    that round's pair (mean of the probes before and after it: ``share_best`` with their best passes,
    ``share_median`` with their median passes), as ``ratios.stats``; {} when no file has probes."""
    out: dict = {}
    for path in paths:
        run = json.load(open(path))
        probes = run.get("bandwidth_probe") or []
        slots = run["settings"]["prompt"] + run["settings"]["new"] / 2
        for precision, (ours, theirs) in LLAMACPP_STORAGE.items():
            for fw, storage, cache_bytes in (("msllm", ours, 4), ("llama.cpp", theirs, 2)):
                need = bytes_per_token(SMOLLM2, storage, slots, cache_bytes)
                rows = {"share_best": [], "share_median": [], "gb_s_best": [], "step_ms": []}
                for r in run["runs"]:
                    if (r["precision"], r["framework"], r["batch"]) != (precision, fw, 1) or "error" in r:
                        continue
                    around = [q for q in probes if (q["round"], q["precision"]) == (r["round"], precision)]
                    if not around:
                        continue
                    step_ms = 1e3 / r["decode_tokens_per_s"]
                    best = sum(q["gb_s_best"] for q in around) / len(around)
                    median = sum(q["gb_s_median"] for q in around) / len(around)
                    rows["share_best"].append(1e3 * need / (best * 1e9) / step_ms)
                    rows["share_median"].append(1e3 * need / (median * 1e9) / step_ms)
                    rows["gb_s_best"].append(best)
                    rows["step_ms"].append(step_ms)
                if rows["step_ms"]:
                    out[f"{fw} {precision}"] = {"weights": storage, "bytes_per_token_mb": need / 1e6, "file": path,
                                                **{k: ratios.stats(v) for k, v in rows.items()}}
    return out


def bandwidth(rounds: int) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(2)
    w = np.random.default_rng(0).standard_normal((65536, 4096), dtype=np.float32)
    tw, x = torch.from_numpy(w), torch.ones(4096)
    gb = w.nbytes / 1e9
    out = {"torch_mv_2_threads_gb_s": [], "numpy_sum_1_thread_gb_s": []}
    for _ in range(rounds):
        torch.mv(tw, x)
        t = time.perf_counter()
        for _ in range(3):
            torch.mv(tw, x)
        out["torch_mv_2_threads_gb_s"].append(3 * gb / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(3):
            w.sum()
        out["numpy_sum_1_thread_gb_s"].append(3 * gb / (time.perf_counter() - t))
    out["best_gb_s"] = max(max(v) for v in out.values())
    return out


def main(argv=None):
    p = harness.arg_parser(__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--decode", help="a decode_speed.py result file with --shapes smollm2")
    src.add_argument("--llamacpp", nargs="+", help="llamacpp_speed.py result files (msllm and llama.cpp at each "
                     "precision; several files: e.g. one run per precision)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bandwidth_file", help="a weight_stream_bandwidth.py result: its best variant counts as one "
                   "more reader (torch's mv and numpy's sum read AMD machines' memory slower than it does)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "decode_floor_smollm2.json"))
    a = p.parse_args(argv)
    t0 = time.time()
    steps, slots = batch1_steps(a)
    bw = bandwidth(a.rounds)
    if a.bandwidth_file:
        variant, gb_s = max(json.load(open(a.bandwidth_file))["gb_s_median_of_best_pass"].items(), key=lambda kv: kv[1])
        bw["weight_stream_bandwidth"] = {"file": a.bandwidth_file, "variant": variant, "gb_s": gb_s}
        bw["best_gb_s"] = max(bw["best_gb_s"], gb_s)
    rows = {}
    for name, (storage, cache_bytes, step_ms) in steps.items():
        need = bytes_per_token(SMOLLM2, storage, slots, cache_bytes)
        floor_ms = 1e3 * need / (bw["best_gb_s"] * 1e9)
        rows[name] = {"weights": storage, "cache_bytes_per_element": cache_bytes, "bytes_per_token_mb": need / 1e6,
                      "floor_ms": floor_ms, "step_ms": step_ms, "share_of_floor": floor_ms / step_ms}
    result = {"machine": common.machine(), "command": harness.command_line(), "decode_file": a.decode or a.llamacpp,  # one file or a list
              "model": SMOLLM2, "weight_params": weight_params(SMOLLM2), "mean_slots": slots,
              "bandwidth": bw, "batch1": rows,
              "bytes_per_token_mb": {k: bytes_per_token(SMOLLM2, k, slots) / 1e6 for k in ("fp32", "bf16", "int8", "q8_0")}}
    live = same_minute(a.llamacpp) if a.llamacpp else {}
    if live:
        result["batch1_same_minute"] = live
    table = ["| framework | weights | MB read per token | floor ms (at %.1f GB/s) | measured ms/step | share of floor |"
             % bw["best_gb_s"], "|---|---|---|---|---|---|"]
    for n, r in rows.items():
        table.append(f"| {n} | {r['weights']} | {r['bytes_per_token_mb']:.0f} "
                     f"| {r['floor_ms']:.1f} | {r['step_ms']:.1f} | {100 * r['share_of_floor']:.0f}% |")
    if live:
        table += ["", "Each round against the bandwidth probed around it (llamacpp_speed.py --bandwidth_probe):", "",
                  "| framework | weights | GB/s (best passes) | ms/step | share of floor, best passes | "
                  "share, median passes |", "|---|---|---|---|---|---|"]
        for n, r in live.items():
            table.append(f"| {n} | {r['weights']} | {ratios.fmt(r['gb_s_best'], 1)} | {ratios.fmt(r['step_ms'], 1)} "
                         f"| {ratios.fmt(r['share_best'])} | {ratios.fmt(r['share_median'])} |")
    harness.finish(a.out, result, "\n".join(table), t0)


if __name__ == "__main__":
    main()
