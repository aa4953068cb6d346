"""msllm's server against ``llama-server`` (issue #32): 8 concurrent streaming clients on SmolLM2-135M-Instruct,
the same precision on both sides, alternating round by round.

Both servers are OpenAI-compatible, so one client drives both (``serve_throughput.wave``: the official
``openai`` client, ``POST /v1/completions``, ``stream: true``, all 8 requests started together, each a 512-token
prompt given as token ids, ``max_tokens`` 64, ``temperature`` 0). Per round and server: the server starts, one
untimed wave (msllm compiles what its start-up warm-up did not; llama.cpp allocates), then ``--reps`` timed
waves. Figures per wave: completion tokens over the wave's wall time, the median time to a client's first
streamed token. Completion tokens come from ``usage`` where the server sends it, else from the number of
streamed chunks with text (llama-server streams one token per chunk).

* msllm: ``tools/serve.py`` with the SmolLM2 run YAML, ``--max_batch 8`` (continuous batching),
  ``param_init_type`` float32 / bfloat16 / int8 (``--precision f32 | bf16 | int8``); ``--precision bf16c``: bfloat16
  weights with ``compute_dtype: bfloat16``, against the same bf16 GGUF.
* llama.cpp: ``llama-server`` of the cached build (``benchmarks/llamacpp_build.sh``) on the same directory
  converted to GGUF (``llamacpp_speed.gguf_file``: f32 / bf16 / q8_0), ``-t 2 -tb 2 --parallel 8``
  (continuous batching is llama-server's default), ``-c 8 x (512 + 64 + 16)`` so every slot holds its
  request; ``--no-repack`` where the repacked (AMX) path crashes on this machine (recorded).

Both stop a request at the model's end-of-turn token (as the OpenAI API does; ``per_client_tokens``
records the counts), so both count the tokens they actually produced.

    .venv/bin/python benchmarks/serve_llamacpp.py --rounds 3 --precision f32 \\
        --out benchmarks/results/serve_llamacpp_f32_<machine>.json
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import decode_speed  # noqa: E402
import harness  # noqa: E402
import llamacpp_speed  # noqa: E402
import ratios  # noqa: E402
import serve_throughput as st  # noqa: E402

# llama-server keeps each slot's last prompt and reuses its KV when the next request starts the same way
# (``cache_prompt``, on by default): the timed waves resend the same 8 prompts, so without this every wave after
# the first would skip its prefill (measured: first token 0.16 s against msllm's 2.7 s). msllm's server reuses a
# prefix only with --enable_prefix_caching (off here), so both prefill every prompt.
NO_PROMPT_REUSE = {"cache_prompt": False}

# --precision -> (msllm param_init_type, GGUF outtype)
PRECISIONS = {"f32": ("float32", "f32"), "bf16": ("bfloat16", "bf16"), "int8": ("int8", "q8_0"),
              "bf16c": ("bfloat16", "bf16")}
# further msllm overrides: bf16c = bf16 weights with compute_dtype bfloat16 (the prompt's GEMMs round the activations
# to bf16, llama.cpp's bf16 arithmetic; docs/serving.md)
EXTRA = {"bf16c": ("--model.model_config.compute_dtype=bfloat16",)}


def start_llama_server(bin_dir: str, gguf: str, a, no_repack: bool):
    """``llama-server`` on a free port; (process, url, start seconds, log path)."""
    port = st.free_port()
    cmd = [os.path.join(bin_dir, "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(a.threads), "-tb", str(a.threads), "--parallel", str(st.CLIENTS),
           "-c", str(st.CLIENTS * (a.prompt + a.new + 16)), "-b", "2048", "-ub", "512", "--alias", "smollm2"]
    if no_repack:
        cmd.append("--no-repack")
    log = os.path.join(common.CACHE, "serve_llamacpp_server.log")
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 300:
        if proc.poll() is not None:
            return None, url, time.time() - t0, log
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return proc, url, time.time() - t0, log
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"llama-server did not answer within 300 s; see {log}")


def timed_waves(url: str, prompts: list, a, extra_body=None) -> dict:
    cold_t = time.perf_counter()
    cold = st.wave(url, prompts, a.new, extra_body)
    cold_s = time.perf_counter() - cold_t
    waves = [st.wave(url, prompts, a.new, extra_body) for _ in range(a.reps)]
    best = {k: common.median([w[k] for w in waves]) for k in ("tokens_per_s", "wall_s", "ttft_median_s", "ttft_max_s")}
    return {"cold_wave_s": cold_s, **best, "tokens": waves[0]["tokens"],
            "texts_repeat": all(w["texts"] == cold["texts"] for w in waves), "texts": cold["texts"],
            "waves": [{k: v for k, v in w.items() if k != "texts"} for w in waves]}


def msllm_round(model_dir, prompts, a) -> dict:
    weights = PRECISIONS[a.precision][0]
    load = common.loadavg()
    proc, url, start_s = st.start_server(model_dir, weights, a.threads, extra=EXTRA.get(a.precision, ()))
    try:
        r = timed_waves(url, prompts, a)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return {"framework": "msllm", "start_s": start_s, "load_before": load, **r}


def llamacpp_round(bin_dir, gguf, prompts, a, state) -> dict:
    load = common.loadavg()
    proc, url, start_s, log = start_llama_server(bin_dir, gguf, a, state["no_repack"])
    if proc is None and not state["no_repack"]:
        state["no_repack"], state["first_attempt"] = True, "llama-server exited at start; rerun with --no-repack"
        proc, url, start_s, log = start_llama_server(bin_dir, gguf, a, True)
    if proc is None:
        raise RuntimeError(f"llama-server exited at start; see {log}")
    try:
        try:
            r = timed_waves(url, prompts, a, NO_PROMPT_REUSE)
        except Exception:
            if state["no_repack"] or proc.poll() is None:
                raise
            # the repacked AMX path crashed under load (llamacpp_speed.py's docstring): once with --no-repack
            state["no_repack"], state["first_attempt"] = True, "llama-server crashed in a wave; rerun with --no-repack"
            proc, url, start_s, log = start_llama_server(bin_dir, gguf, a, True)
            r = timed_waves(url, prompts, a, NO_PROMPT_REUSE)
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
    return {"framework": "llama.cpp", "start_s": start_s, "load_before": load, "no_repack": state["no_repack"], **r}


def main(argv=None):
    import numpy as np

    p = harness.arg_parser(__doc__)
    p.add_argument("--precision", default="f32", choices=list(PRECISIONS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--note", default="")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.out = a.out or os.path.join(HERE, "results", f"serve_llamacpp_{a.precision}.json")
    model_dir = decode_speed.model_dir("smollm2")
    prompts = np.load(decode_speed.prompts_file(a.prompt))["ids"][:st.CLIENTS].tolist()
    bin_dir = llamacpp_speed.llamacpp_bin()
    gguf = llamacpp_speed.gguf_file(bin_dir, model_dir, PRECISIONS[a.precision][1])
    info = common.machine()
    print(f"# {info}\n# {st.CLIENTS} clients, prompt {a.prompt}, new {a.new}, {a.precision}, {a.rounds} rounds", flush=True)
    t0, runs, state = time.time(), [], {"no_repack": False, "first_attempt": None}
    for rnd in range(a.rounds):
        order = ("msllm", "llama.cpp") if rnd % 2 == 0 else ("llama.cpp", "msllm")
        for who in order:
            r = msllm_round(model_dir, prompts, a) if who == "msllm" else llamacpp_round(bin_dir, gguf, prompts, a, state)
            r["round"] = rnd
            runs.append(r)
            print(f"round {rnd} {who:9s} {r['tokens_per_s']:7.1f} tok/s  wave {r['wall_s']:.2f} s  tokens {r['tokens']}  "
                  f"ttft median {r['ttft_median_s']:.2f} s  load {r['load_before']}", flush=True)
    by_round = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["framework"]] = r
    pairs = [(d["msllm"], d["llama.cpp"]) for d in by_round.values()]
    summary = {
        "msllm_tokens_per_s": common.median([m["tokens_per_s"] for m, _ in pairs]),
        "llamacpp_tokens_per_s": common.median([c["tokens_per_s"] for _, c in pairs]),
        "throughput_ratio_paired": ratios.stats([m["tokens_per_s"] / c["tokens_per_s"] for m, c in pairs]),
        "msllm_ttft_median_s": common.median([m["ttft_median_s"] for m, _ in pairs]),
        "llamacpp_ttft_median_s": common.median([c["ttft_median_s"] for _, c in pairs]),
        # llama.cpp's first-token time over msllm's: above 1, msllm's first token comes sooner
        "ttft_sooner_paired": ratios.stats([c["ttft_median_s"] / m["ttft_median_s"] for m, c in pairs]),
        # greedy at the same precision: how many of the rounds x 8 completions are the same text on both servers
        "completions_equal_between_servers": sum(x == y for m, c in pairs for x, y in zip(m["texts"], c["texts"])),
        "llamacpp_no_repack": state["no_repack"], "llamacpp_first_attempt": state["first_attempt"],
    }
    for r in runs:
        r.pop("texts", None)
    s = summary
    table = ("| precision | msllm server tok/s | llama-server --parallel 8 tok/s | x llama-server (paired) | "
             "msllm first token s (median) | llama-server first token s | first token x sooner (paired) |\n"
             "|---|---|---|---|---|---|---|\n"
             f"| {a.precision} | {s['msllm_tokens_per_s']:.1f} | {s['llamacpp_tokens_per_s']:.1f} | "
             f"{ratios.fmt(s['throughput_ratio_paired'])} | {s['msllm_ttft_median_s']:.2f} | "
             f"{s['llamacpp_ttft_median_s']:.2f} | {ratios.fmt(s['ttft_sooner_paired'])} |")
    result = {"machine": info, "command": harness.command_line(), "settings": vars(a), "note": a.note,
              "total_seconds": time.time() - t0, "summary": summary, "runs": runs}
    harness.finish(a.out, result, table, t0)


if __name__ == "__main__":
    main()
