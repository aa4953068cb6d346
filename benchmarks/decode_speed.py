"""Decode speed, side by side: msllm (KV cache, GRAPH_MODE) vs transformers ``generate`` (torch
eager, 2 threads, its KV cache) vs msllm with ``use_past: False`` (the whole sequence again for
every token), on the same weights and the same prompts, fp32, one process each.

Shapes: ``demo`` (configs/llama/run_llama_tiny.yaml: hidden 128, 4 layers, 4 heads / 2 kv heads,
FFN 352, vocab 32000), and the shared NOTES ``tiny`` (hidden 256, 4 layers, 4 heads, FFN 688) and
``medium`` (hidden 512, 8 layers, 8 heads, FFN 1376), vocab 32000. Weights: random
(``msllm.convert.verify.write_random_hf_dir``, seeded), saved once as an HF directory under
``benchmarks/.cache`` that both frameworks load (msllm converts it in memory, as predict does).
Prompts: real text (the bundled Alpaca records, LLaMA tokenizer), ``[bos]`` + 127 tokens, 8
different windows; batch 1 uses the first. 128 new tokens, greedy, no EOS stop.

Runs alternate (msllm, torch, torch with ``OMP_WAIT_POLICY=PASSIVE``, msllm-nocache, and with
``--frameworks``: msllm-composed, msllm-bf16 = weights kept in bfloat16, msllm-bf16c = the same with
``compute_dtype: bfloat16`` (GEMM activations rounded to bfloat16), msllm-int8 = weight-only int8
per output channel) per shape
and batch size, round after round, so the machine's background load hits them alike
(msllm-nocache only at ``--nocache_batches``, default 1). Per run: one cold ``generate``
(compiles; its extra time over a warm one is reported as compile time) and ``--reps`` warm ones.

    .venv/bin/python benchmarks/decode_speed.py                          # all shapes, batch 1 and 8
    .venv/bin/python benchmarks/decode_speed.py --shapes tiny --batches 1 --rounds 1

Reports per framework: decode tokens/s (B x 127 tokens after the first, over their wall time),
ms per decode step, time to first token (prefill + first token), compile time, peak RSS; the
ratios msllm / transformers (paired per round, median) against issue #23's targets (decode >= 1.0x at
batch 1, >= 1.5x at batch 8; time to first token no worse); ``--shapes smollm2`` runs the real
SmolLM2-135M-Instruct; whether msllm's greedy tokens equal
transformers' (row 0). Writes ``benchmarks/results/decode_speed.json`` and prints a Markdown table.
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

SHAPES = {
    "demo": dict(vocab_size=32000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=352),
    "tiny": dict(vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, intermediate_size=688),
    "medium": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=8, intermediate_size=1376),
}
# name -> (worker script, worker arguments, extra environment)
WORKERS = {"msllm": ("decode_msllm.py", {"use_past": True}, {}),
           "torch-eager": ("decode_torch.py", {}, {}),
           # torch's OpenMP threads spin while waiting (OMP_WAIT_POLICY default); on a shared,
           # loaded machine a descheduled thread then stalls every parallel region. PASSIVE makes
           # them sleep: the fairer torch on a busy machine, a slower one on an idle machine.
           "torch-eager-passive": ("decode_torch.py", {}, {"OMP_WAIT_POLICY": "PASSIVE"}),
           "msllm-nocache": ("decode_msllm.py", {"use_past": False}, {}),
           # the model without its CPU fast paths (MindSpore's own operators instead of msllm's kernels)
           "msllm-composed": ("decode_msllm.py", {"use_past": True, "fast_paths": False}, {}),
           # weights kept in bfloat16 (param_init_type), float32 arithmetic: half the bytes per token
           "msllm-bf16": ("decode_msllm.py", {"use_past": True,
                                              "overrides": ["--model.model_config.param_init_type=bfloat16"]}, {}),
           # bfloat16 weights and compute_dtype bfloat16 (inference): the GEMMs take the weights as stored
           # and round the activations to bfloat16 (llama.cpp's bf16 arithmetic); decode steps' fused
           # layers keep float32 activations
           "msllm-bf16c": ("decode_msllm.py", {"use_past": True,
                                               "overrides": ["--model.model_config.param_init_type=bfloat16",
                                                             "--model.model_config.compute_dtype=bfloat16"]}, {}),
           # weight-only int8 (issue #32: param_init_type int8 = RTN per output channel, the head too),
           # float32 arithmetic: about a quarter of float32's bytes per token
           "msllm-int8": ("decode_msllm.py", {"use_past": True,
                                              "overrides": ["--model.model_config.param_init_type=int8"]}, {})}
# the real model of issue #19 (SmolLM2-135M-Instruct, tied head, 9 / 3 heads, vocab 49152): its own
# HF directory (msllm.convert.real_model), not random weights
REAL = ("smollm2",)
# issue #23's targets: decode tokens/s vs transformers per batch size, time to first token no worse
TARGETS = {1: 1.0, 8: 1.5}
TTFT_LIMIT = 1.0


def positions_for(prompt: int, new: int) -> int:
    """The random-weight shapes' context: 512 positions, or the next power of two that holds
    ``prompt + new`` tokens (a 512-token prompt with 64 new tokens needs 1024; the weights are the
    same, seed 0, only the rotary tables are longer)."""
    return max(512, 1 << (prompt + new - 1).bit_length())


def model_dir(shape: str, positions: int = 512) -> str:
    """The HF directory of ``shape`` (random weights, seed 0) with ``positions`` positions, written
    once; the real model's own."""
    if shape in REAL:
        return common.hf_dir(shape)
    out = os.path.join(common.CACHE, f"decode_{shape}_hf" if positions == 512 else f"decode_{shape}_{positions}pos_hf")
    if not os.path.exists(os.path.join(out, "config.json")):
        common.use_repo()
        from msllm.convert.verify import write_random_hf_dir

        write_random_hf_dir(out, seed=0, max_position_embeddings=positions, **SHAPES[shape])
    return out


def prompts_file(length: int, rows: int = 8) -> str:
    """``rows`` windows of real text, ``[bos]`` + ``length - 1`` tokens each, as an .npz ``ids``."""
    out = os.path.join(common.CACHE, f"decode_prompts_{length}x{rows}.npz")
    if os.path.exists(out):
        return out
    common.use_repo()
    import numpy as np

    from msllm.data.tokenizer import LlamaTokenizer

    tok = LlamaTokenizer(os.path.join(common.EXAMPLES, "tokenizer.model"))
    records = json.load(open(os.path.join(common.EXAMPLES, "alpaca_en_demo.json"), encoding="utf-8"))
    stream = []
    for r in records:
        stream += tok.encode(f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}")
        if len(stream) > rows * length:
            break
    ids = np.array([[tok.bos_id] + stream[i * length:(i + 1) * length - 1] for i in range(rows)], np.int32)
    os.makedirs(common.CACHE, exist_ok=True)
    np.savez(out, ids=ids)
    return out


def run_worker(name: str, shape: str, batch: int, a, timeout: float) -> dict:
    script, kw, env_extra = WORKERS[name]
    args = {"model_dir": model_dir(shape, positions_for(a.prompt, a.new)), "prompts": prompts_file(a.prompt),
            "batch": batch, "new": a.new,
            "reps": a.reps, "threads": a.threads, **kw}
    return harness.run_worker(name, script, args, timeout, env_extra={"OMP_NUM_THREADS": str(a.threads), **env_extra},
                             cwd=common.CACHE)


def summarise(runs: list[dict]) -> dict:
    """Per (shape, batch): medians per framework and paired msllm / transformers ratios."""
    out = {}
    for key in sorted({(r["shape"], r["batch"]) for r in runs}):
        rows = [r for r in runs if (r["shape"], r["batch"]) == key]
        table = {}
        for n in WORKERS:
            ok, error = harness.ok_runs(rows, n)
            if not ok:
                if error:
                    table[n] = {"error": error}
                continue
            table[n] = {k: common.median([r[k] for r in ok]) for k in
                        ("decode_tokens_per_s", "decode_step_ms", "ttft_s", "compile_s")}
            table[n].update(runs=len(ok), peak_rss_mib=max(r["peak_rss_mib"] for r in ok),
                            decode_all=[round(r["decode_tokens_per_s"], 1) for r in ok],
                            loads=[r["load_before"] for r in ok])
        by_round = {}
        for r in rows:
            if "error" not in r:
                by_round.setdefault(r["round"], {})[r["framework"]] = r
        for n in ("msllm", "msllm-bf16", "msllm-int8", "msllm-nocache"):
            for ref, suffix in (("torch-eager", ""), ("torch-eager-passive", "_passive")):
                pairs = [(d[n], d[ref]) for d in by_round.values() if n in d and ref in d]
                if pairs and n in table and "error" not in table[n]:   # median (min, max) of the paired rounds
                    for what, field in (("decode_ratio", "decode_tokens_per_s"), ("ttft_ratio", "ttft_s")):
                        st = ratios.stats([a[field] / b[field] for a, b in pairs])
                        table[n][what + suffix], table[n][what + suffix + "_paired"] = st["median"], st
                    table[n]["tokens_equal_torch"] = all(a["tokens_row0"] == b["tokens_row0"] for a, b in pairs)
        for n in ("msllm", "msllm-bf16", "msllm-int8"):
            m = table.get(n, {})
            if "decode_ratio" in m:
                m["decode_target"] = TARGETS.get(key[1], 1.0)
                m["decode_target_met"] = m["decode_ratio"] >= m["decode_target"]
                m["ttft_target_met"] = m["ttft_ratio"] <= TTFT_LIMIT
        out[f"{key[0]}/b{key[1]}"] = table
    return out


def markdown(summary: dict) -> str:
    lines = ["| shape / batch | framework | decode tokens/s | ms / step | time to 1st token ms | compile s "
             "| peak RSS MiB | x transformers decode | x transformers TTFT | x passive-torch decode / TTFT "
             "| same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(n, r):
        def pr(k):   # a paired ratio: median (min-max) over the rounds
            return ratios.fmt(r[k + "_paired"]) if k + "_paired" in r else f"{r[k]:.2f}"

        ratio = pr("decode_ratio") if "decode_ratio" in r else ""
        if "decode_target" in r:
            ratio += f" (target {r['decode_target']:.1f}: {'met' if r['decode_target_met'] else 'MISSED'})"
        tt = pr("ttft_ratio") if "ttft_ratio" in r else ""
        if "ttft_target_met" in r:
            tt += f" ({'met' if r['ttft_target_met'] else 'MISSED'})"
        same = "" if "tokens_equal_torch" not in r else ("yes" if r["tokens_equal_torch"] else "no")
        passive = (f"{pr('decode_ratio_passive')} / {pr('ttft_ratio_passive')}"
                   if "decode_ratio_passive" in r else "")
        return (f"| {key} | {n} | {r['decode_tokens_per_s']:.1f} | {r['decode_step_ms']:.1f} "
                f"| {1000 * r['ttft_s']:.1f} | {r['compile_s']:.1f} | {r['peak_rss_mib']:.0f} | {ratio} "
                f"| {tt} | {passive} | {same} |")

    for key, table in summary.items():
        lines += harness.md_rows(table, row, prefix=f"{key} | ")
    return "\n".join(lines)


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES) + list(REAL))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--frameworks", default=",".join(WORKERS))
    p.add_argument("--nocache_batches", nargs="+", type=int, default=[1],
                   help="batch sizes msllm-nocache runs at (it recomputes the whole sequence per token: "
                        "medium x 8 rows takes minutes per generate)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=2, help="warm generate calls per run")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "decode_speed.json"))
    a = p.parse_args(argv)
    names = [n for n in a.frameworks.split(",") if n]
    info = common.machine()
    print(f"# {info}\n# shapes {a.shapes}, batches {a.batches}, prompt {a.prompt}, new {a.new}, "
          f"{a.rounds} rounds of {names}", flush=True)
    for s in a.shapes:
        model_dir(s, positions_for(a.prompt, a.new))
    prompts_file(a.prompt)
    t0 = time.time()
    runs = []
    for rnd in range(a.rounds):
        for shape in a.shapes:
            for batch in a.batches:
                for n in names:
                    if n == "msllm-nocache" and batch not in a.nocache_batches:
                        continue
                    r = run_worker(n, shape, batch, a, a.timeout)
                    r.update(round=rnd, shape=shape, batch=batch)
                    harness.log_run(runs, r, f"round {rnd} {shape:6s} b{batch} {n:14s}", lambda r: (
                        f"decode {r['decode_tokens_per_s']:8.1f} tok/s ({r['decode_step_ms']:.1f} ms/step)  "
                        f"ttft {1000 * r['ttft_s']:.0f} ms  compile {r['compile_s']:.1f} s  "
                        f"RSS {r['peak_rss_mib']:.0f} MiB  load {r['load_before']}"))
    summary = summarise(runs)
    result = {"machine": info, "command": harness.command_line(), "settings": vars(a),
              "total_seconds": time.time() - t0, "summary": summary, "runs": runs}
    harness.finish(a.out, result, markdown(summary), t0)

if __name__ == "__main__":
    main()
