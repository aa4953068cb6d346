"""Continuous against static batching in the OpenAI-compatible server: requests of mixed prompt
and output lengths arriving one after another (not in a burst), on the real SmolLM2-135M-Instruct.

The same server, ``tools/serve.py --max_batch 8``, from two checkouts, alternating round by
round: this one (continuous batching: a request joins the running batch between two decode
steps, a finished row is free at the next) and ``--static_ref`` (a git revision whose engine ran
static batches: requests that arrive during a batch wait for all of it to end; default 4280bad,
the last such commit). Workload (deterministic): ``--requests`` streaming completions (the
official ``openai`` client, ``temperature`` 0, no stop), request i sent at i x ``--gap`` seconds,
its prompt the first ``PROMPT_LENGTHS[i % 4]`` tokens of one of the 512-token windows of
``benchmarks/decode_speed.py``, ``max_tokens`` ``NEW_TOKENS[i % 4]``. Per server and round: the
server starts, one untimed pass of the workload compiles its graphs, then one timed pass.
Figures: completion tokens over the pass's wall time (first request sent to last ``[DONE]``),
each request's latency (sent to ``[DONE]``) and time to its first streamed token (median, 90th
percentile). Both servers must give every request the same text (greedy decoding; checked).

    .venv/bin/python benchmarks/serve_arrivals.py [--rounds 3] [--requests 16] [--gap 0.4]
        [--static_ref 4280bad] [--out benchmarks/results/serve_arrivals_smollm2.json]
"""

from __future__ import annotations

import json
import os
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
import serve_throughput  # noqa: E402

PROMPT_LENGTHS = (128, 256, 512, 64)
NEW_TOKENS = (16, 128, 32, 64)


def checkout(ref: str) -> str:
    """A worktree of ``ref`` in the benchmark cache with its CPU kernels built (reused)."""
    path = os.path.join(common.CACHE, f"worktree_{ref}")
    if not os.path.exists(os.path.join(path, "tools", "serve.py")):
        subprocess.run(["git", "-C", common.ROOT, "worktree", "add", "--force", "--detach", path, ref], check=True)
    subprocess.run([sys.executable, "-m", "msllm.kernels.build"], cwd=path, check=True)
    return path


def workload(n: int) -> list:
    """[(prompt ids, max_tokens)] of the module docstring."""
    import numpy as np

    windows = np.load(decode_speed.prompts_file(512))["ids"].tolist()
    return [(windows[i % len(windows)][:PROMPT_LENGTHS[i % 4]], NEW_TOKENS[i % 4]) for i in range(n)]


def percentile(xs, q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(xs, float), q))


def run_pass(url: str, work: list, gap: float) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1200)
    out = [None] * len(work)
    t0 = time.perf_counter()

    def one(i):
        time.sleep(max(0.0, t0 + i * gap - time.perf_counter()))
        out[i] = serve_throughput.stream_one(client, *work[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    lat = [r[1] for r in out]
    firsts = [r[0] for r in out if r[0] is not None]
    tokens = sum(r[2] for r in out)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_median_s": percentile(lat, 50), "latency_p90_s": percentile(lat, 90),
            "ttft_median_s": percentile(firsts, 50), "ttft_p90_s": percentile(firsts, 90),
            "per_request": [{"ttft_s": r[0], "latency_s": r[1], "tokens": r[2]} for r in out],
            "texts": [r[3] for r in out]}


def server_round(name: str, root: str, work: list, a) -> dict:
    proc, url, start_s = serve_throughput.start_server(decode_speed.model_dir("smollm2"), "float32", a.threads,
                                                       root=root, max_batch=8)
    try:
        t = time.perf_counter()
        cold = run_pass(url, work, a.gap)
        warm_s = time.perf_counter() - t
        timed = run_pass(url, work, a.gap)
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            health = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return {"framework": name, "start_s": start_s, "untimed_pass_s": warm_s, **timed,
            "same_text_as_untimed": timed["texts"] == cold["texts"], "health": health,
            "exit_code": proc.returncode, "load_before": common.loadavg()}


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--gap", type=float, default=0.4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--static_ref", default="4280bad")
    p.add_argument("--out", default=os.path.join(HERE, "results", "serve_arrivals_smollm2.json"))
    a = p.parse_args(argv)
    static_root = checkout(a.static_ref)
    work = workload(a.requests)
    info = common.machine()
    print(f"# {info}\n# {a.requests} requests every {a.gap} s, {a.rounds} rounds, static = {a.static_ref}", flush=True)
    t0 = time.time()
    runs = []
    for rnd in range(a.rounds):
        for name, root in (("msllm-continuous", common.ROOT), (f"msllm-static-{a.static_ref}", static_root)):
            r = server_round(name, root, work, a)
            r["round"] = rnd
            runs.append(r)
            print(f"round {rnd} {name:24s} {r['tokens_per_s']:6.1f} tok/s  wall {r['wall_s']:6.2f} s  latency "
                  f"median {r['latency_median_s']:.2f} p90 {r['latency_p90_s']:.2f} s  ttft median "
                  f"{r['ttft_median_s']:.2f} p90 {r['ttft_p90_s']:.2f} s", flush=True)
    cont, stat = runs[0::2], runs[1::2]
    keys = ("tokens_per_s", "wall_s", "latency_median_s", "latency_p90_s", "ttft_median_s", "ttft_p90_s")
    summary = {side: {k: common.median([r[k] for r in rs]) for k in keys} for side, rs in
               (("continuous", cont), ("static", stat))}
    # the median (min, max) of the per-round paired ratios
    summary["throughput_ratio_paired"] = ratios.stats([c["tokens_per_s"] / s["tokens_per_s"]
                                                       for c, s in zip(cont, stat)])
    summary["throughput_ratio"] = summary["throughput_ratio_paired"]["median"]
    summary["same_texts_both_servers"] = all(c["texts"] == s["texts"] for c, s in zip(cont, stat))
    for r in runs:
        r.pop("texts")
    result = {"machine": info, "command": harness.command_line(), "settings": vars(a),
              "workload": {"prompt_lengths": PROMPT_LENGTHS, "new_tokens": NEW_TOKENS},
              "total_seconds": time.time() - t0, "summary": summary, "runs": runs}
    c, s = summary["continuous"], summary["static"]
    table = ("| batching | tok/s | wall s | latency median / p90 s | first token median / p90 s |\n"
             "|---|---|---|---|---|\n" + "".join(
                 f"| {name} | {x['tokens_per_s']:.1f} | {x['wall_s']:.2f} | {x['latency_median_s']:.2f} / "
                 f"{x['latency_p90_s']:.2f} | {x['ttft_median_s']:.2f} / {x['ttft_p90_s']:.2f} |\n"
                 for name, x in (("continuous", c), (f"static ({a.static_ref})", s))))
    harness.finish(a.out, result, table, t0)


if __name__ == "__main__":
    main()
