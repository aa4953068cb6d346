"""The OpenAI-compatible server under load: 8 concurrent streaming clients against
``tools/serve.py`` on the real SmolLM2-135M-Instruct, beside transformers' ``generate`` on the
same 8 prompts as one batch (torch eager, 2 threads), alternating round by round.

Each client sends one ``POST /v1/completions`` (the official ``openai`` client, ``stream: true``,
``stream_options.include_usage``) with a 512-token prompt given as token ids (the windows of
``benchmarks/decode_speed.py``), ``max_tokens`` 64, ``temperature`` 0, no stop; all 8 start
together. Per server round: the server process starts, one untimed wave of the 8 requests
compiles its graphs, then ``--reps`` timed waves. Figures per wave: new tokens (from ``usage``)
over the wave's wall time (first request sent to last ``[DONE]``), and the median time to each
client's first streamed token. A request stops at the model's end-of-turn token (OpenAI's API has
no switch to ignore it), transformers' run does not (64 tokens per row): a row that stops early
counts fewer tokens while its batch still runs to the longest row, so the server's rate is
understated, not flattered; ``per_client_tokens`` records the counts. Transformers: ``workers/decode_torch.py`` at batch 8 with the same
prompts and lengths; its end-to-end rate is 8 x 64 tokens over (time to first token + the decode
time), the same span the server's wave covers.

    .venv/bin/python benchmarks/serve_throughput.py [--rounds 3] [--weights float32|bfloat16]
        [--out benchmarks/results/serve_throughput_smollm2.json]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import decode_speed  # noqa: E402
import harness  # noqa: E402
import ratios  # noqa: E402

CONFIG = os.path.join(common.ROOT, "configs", "smollm2", "run_smollm2_135m.yaml")
CLIENTS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, weights: str, threads: int, root: str = common.ROOT, max_batch: int = CLIENTS,
                 extra: tuple = ()):
    """``tools/serve.py`` of the checkout at ``root`` on a free port, ``extra`` further overrides; (process, url,
    start seconds)."""
    port = free_port()
    cmd = [sys.executable, os.path.join(root, "tools", "serve.py"), "--config", CONFIG,
           "--load_checkpoint", model_dir, "--port", str(port), "--model_name", "smollm2",
           "--max_batch", str(max_batch), f"--model.model_config.param_init_type={weights}", *extra]
    env = dict(os.environ, GLOG_v="3", OMP_NUM_THREADS=str(threads))
    log = open(os.path.join(common.CACHE, "serve_throughput_server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}; see {log.name}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return proc, url, time.time() - t0
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not answer within 600 s")


def stream_one(client, prompt, new: int, extra_body=None) -> tuple:
    """One streamed greedy completion: (seconds to the first text chunk or None, seconds to the
    end, completion tokens from ``usage``, text). ``extra_body``: server-specific request fields."""
    t = time.perf_counter()
    first, text, usage = None, [], None
    for chunk in client.completions.create(model="smollm2", prompt=prompt, max_tokens=new, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body=extra_body):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter() - t
            text.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    # a server without ``usage`` in the stream (llama-server streams one token per chunk): the chunk count
    return first, time.perf_counter() - t, usage if usage is not None else len(text), "".join(text)


def wave(url: str, prompts: list, new: int, extra_body=None) -> dict:
    """All clients at once; per client (first-token s, done s, completion tokens, text)."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    results = [None] * len(prompts)
    go = threading.Barrier(len(prompts) + 1)

    def one(i):
        go.wait()
        results[i] = stream_one(client, prompts[i], new, extra_body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    go.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    firsts = [r[0] for r in results if r[0] is not None]   # a request that ends at once (EOS) streams no text
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "per_client_tokens": [r[2] for r in results],
            "ttft_median_s": common.median(firsts), "ttft_max_s": max(firsts), "texts": [r[3] for r in results]}


def server_round(model_dir, prompts, a) -> dict:
    proc, url, start_s = start_server(model_dir, a.weights, a.threads)
    try:
        t = time.perf_counter()
        cold = wave(url, prompts, a.new)
        compile_s = time.perf_counter() - t
        waves = [wave(url, prompts, a.new) for _ in range(a.reps)]
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    best = {k: common.median([w[k] for w in waves]) for k in ("tokens_per_s", "wall_s", "ttft_median_s", "ttft_max_s")}
    same = all(w["texts"] == cold["texts"] for w in waves)
    return {"framework": f"msllm-server-{a.weights}", "start_s": start_s, "cold_wave_s": compile_s, **best,
            "tokens": waves[0]["tokens"], "waves": [{k: v for k, v in w.items() if k != "texts"} for w in waves],
            "texts_repeat": same, "exit_code": proc.returncode, "load_before": common.loadavg()}


def main(argv=None):
    import numpy as np

    p = harness.arg_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "serve_throughput_smollm2.json"))
    a = p.parse_args(argv)
    model_dir = decode_speed.model_dir("smollm2")
    prompts = np.load(decode_speed.prompts_file(a.prompt))["ids"][:CLIENTS].tolist()
    info = common.machine()
    print(f"# {info}\n# {CLIENTS} clients, prompt {a.prompt}, new {a.new}, weights {a.weights}, {a.rounds} rounds",
          flush=True)
    t0 = time.time()
    runs = []
    for rnd in range(a.rounds):
        r = server_round(model_dir, prompts, a)
        r["round"] = rnd
        runs.append(r)
        print(f"round {rnd} server  {r['tokens_per_s']:7.1f} tok/s  wave {r['wall_s']:.2f} s  "
              f"ttft median {r['ttft_median_s']:.2f} s  load {r['load_before']}", flush=True)
        t = decode_speed.run_worker("torch-eager", "smollm2", CLIENTS,
                                    type("A", (), {"prompt": a.prompt, "new": a.new, "reps": a.reps,
                                                   "threads": a.threads})(), a.timeout)
        if "error" not in t:
            t["tokens_per_s"] = CLIENTS * a.new / (t["ttft_s"] + CLIENTS * (a.new - 1) / t["decode_tokens_per_s"])
        t.update(round=rnd, framework="torch-eager-generate-b8")
        runs.append(t)
        print(f"round {rnd} torch   {t.get('tokens_per_s', float('nan')):7.1f} tok/s  "
              f"ttft {t.get('ttft_s', float('nan')):.2f} s", flush=True)
    pairs = [(s, t) for s, t in zip(runs[0::2], runs[1::2]) if "error" not in t]
    summary = {
        "server_tokens_per_s": common.median([s["tokens_per_s"] for s in runs[0::2]]),
        "torch_tokens_per_s": common.median([t["tokens_per_s"] for _, t in pairs]) if pairs else None,
        "ratio": common.median([s["tokens_per_s"] / t["tokens_per_s"] for s, t in pairs]) if pairs else None,
        # the median (min, max) of the per-round paired ratios: tokens/s, and transformers' time to first
        # token over the server's median one (above 1: the server's first token comes sooner)
        "ratio_paired": ratios.stats([s["tokens_per_s"] / t["tokens_per_s"] for s, t in pairs]),
        "ttft_sooner_paired": ratios.stats([t["ttft_s"] / s["ttft_median_s"] for s, t in pairs]),
        "server_ttft_median_s": common.median([s["ttft_median_s"] for s in runs[0::2]]),
        "torch_ttft_s": common.median([t["ttft_s"] for _, t in pairs]) if pairs else None,
        "every_wave_same_text": all(s["texts_repeat"] for s in runs[0::2]),
        "server_exit_codes": [s["exit_code"] for s in runs[0::2]],
    }
    result = {"machine": info, "command": harness.command_line(), "settings": vars(a),
              "total_seconds": time.time() - t0, "summary": summary, "runs": runs}
    table = ("| weights | server tok/s (8 streaming clients) | transformers generate b8 tok/s | ratio (paired) | "
             "server median TTFT s | transformers TTFT s | first token x sooner (paired) |\n|---|---|---|---|---|---|---|\n"
             f"| {a.weights} | {summary['server_tokens_per_s']:.1f} | {summary['torch_tokens_per_s'] or 0:.1f} | "
             f"{ratios.fmt(summary['ratio_paired'])} | {summary['server_ttft_median_s']:.2f} | "
             f"{summary['torch_ttft_s'] or 0:.2f} | {ratios.fmt(summary['ttft_sooner_paired'])} |")
    harness.finish(a.out, result, table, t0)


if __name__ == "__main__":
    main()
