"""Inter-token latency of decoding rows while a long prompt joins the serving engine's batch,
chunked prefill against whole, on the real SmolLM2-135M-Instruct (issue #32: "inter-token p99 of
decoding rows while a 2,000-token prompt joins").

In process, one :class:`msllm.serving.engine.Engine` (``--max_batch`` rows, warmed up over caches
of up to ``--warmup_slots`` slots), one mode after the other per round (``--chunks``, e.g. ``0,512,256``: 0 = the
prompt prefilled whole, else ``--prefill_chunk_size``; switched on the same engine, so the same
graphs): ``--rows`` greedy requests with 64-token prompts and ``--new`` new tokens start
together; once each has made 8 tokens, a ``--prompt``-token request joins (4 new tokens). A first,
untimed round compiles the shapes the modes meet. Figures per mode: the gaps between consecutive
tokens of the decoding rows from their last token before the join to their first token after the
long request's first token (p50, p99, max; every row's gaps pooled: with the prompt prefilled
whole, the rows' one stall is one of them), the long request's time to its first token, and the decoding rows'
tokens/s over that window. Every mode must give every request the same tokens (greedy; checked).
Prompts: real text (``benchmarks/decode_speed.py``'s Alpaca windows). ``--prefix`` also turns the
prefix cache on (the long prompt is then new every round: its first tokens differ).

    .venv/bin/python benchmarks/serve_join_latency.py [--rounds 2] [--rows 4] [--prompt 2000]
        [--chunks 0,512,256] [--out benchmarks/results/serve_join_latency_smollm2.json]

Timings depend on the machine's load: the result file records the load average and a note.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import decode_speed  # noqa: E402

CONFIG = os.path.join(common.ROOT, "configs", "smollm2", "run_smollm2_135m.yaml")


class Sink:
    def __init__(self):
        self.times, self.done = [], threading.Event()

    def __call__(self, event):
        if event[0] == "text":
            self.times.append(time.perf_counter())
        elif event[0] in ("done", "error"):
            self.times.append(time.perf_counter())
            self.error = event if event[0] == "error" else None
            self.done.set()


def percentile(xs, q):
    import numpy as np

    return float(np.percentile(np.asarray(xs, float), q)) if xs else None


def one_round(eng, chunk: int, short: list, long: list, new: int) -> dict:
    from msllm.serving.protocol import Job

    eng.batch.chunk = chunk
    sinks = [Sink() for _ in short]
    works = [eng.submit(Job(list(p), new), s) for p, s in zip(short, sinks)]
    t = time.time()
    while any(w.tokens is None or len(w.tokens) < 8 for w in works):
        if time.time() - t > 1200:
            raise RuntimeError("the decoding rows did not start")
        time.sleep(0.005)
    join = Sink()
    t_join = time.perf_counter()
    wl = eng.submit(Job(list(long), 4), join)
    for s in sinks + [join]:
        s.done.wait(3600)
    t_first = join.times[0]
    gaps, made = [], 0
    for s in sinks:
        # the row's last token before the join, its tokens until the long prompt's first, and its
        # first token after that: so a whole prefill's one stall (no row token in the window) is a gap too
        inside = [x for x in s.times[:-1] if t_join <= x <= t_first]
        before = [x for x in s.times[:-1] if x < t_join]
        after = [x for x in s.times[:-1] if x > t_first]
        ts = before[-1:] + inside + after[:1]
        gaps += [b - a for a, b in zip(ts, ts[1:])]
        made += len(inside)
    window = t_first - t_join
    return {"chunk": chunk, "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "itl_max_s": max(gaps) if gaps else None, "gaps": len(gaps), "long_ttft_s": window,
            "rows_tokens_per_s_during_join": made / window if window > 0 else None,
            "tokens": [w.tokens for w in works] + [wl.tokens]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (after one untimed)")
    p.add_argument("--rows", type=int, default=4, help="decoding rows")
    p.add_argument("--max_batch", type=int, default=8)
    p.add_argument("--new", type=int, default=160, help="new tokens of each decoding row")
    p.add_argument("--prompt", type=int, default=2000, help="tokens of the joining prompt")
    p.add_argument("--chunks", default="0,512,256", help="prefill chunk sizes to compare (0: whole)")
    p.add_argument("--prefix", action="store_true", help="prefix cache on as well")
    p.add_argument("--warmup_slots", type=int, default=4096, help="Engine.warmup's widest cache")
    p.add_argument("--note", default="", help="free text stored with the result (e.g. 'shared machine')")
    p.add_argument("--out", default=os.path.join(HERE, "results", "serve_join_latency_smollm2.json"))
    a = p.parse_args(argv)
    common.use_repo()
    import numpy as np

    from msllm.config import load_config
    from msllm.convert.real_model import ensure_smollm2
    from msllm.generation.chat import load_session
    from msllm.serving.engine import Engine

    chunks = [int(x) for x in a.chunks.split(",")]
    cfg = load_config(CONFIG, [f"--load_checkpoint={ensure_smollm2()}"])
    net, mc, _, tok, _, st = load_session(cfg)
    windows = np.load(decode_speed.prompts_file(512))["ids"]
    short = [windows[i % len(windows)][:64].tolist() for i in range(a.rows)]
    stream = windows.reshape(-1).tolist()
    eng = Engine(net, mc, tok, st.eos_token_id, st.pad_token_id, max_batch=a.max_batch, window_s=0.02,
                 prefix_cache_bytes=(1 << 30) if a.prefix else 0, prefill_chunk_size=max(chunks))
    t0 = time.perf_counter()
    eng.warmup(a.warmup_slots)
    warm_s = time.perf_counter() - t0
    eng.start()
    runs = {c: [] for c in chunks}
    for r in range(a.rounds + 1):                                       # round 0: compiles, untimed
        for c in chunks:
            long = [stream[(r * 7 + i) % len(stream)] for i in range(a.prompt)]   # new every round
            res = one_round(eng, c, short, long, a.new)
            print(f"round {r} chunk {c}: itl p50 {res['itl_p50_s']:.3f} s p99 {res['itl_p99_s']:.3f} s, "
                  f"long ttft {res['long_ttft_s']:.2f} s", flush=True)
            if r:
                runs[c].append(res)
    eng.stop(600)
    ref = {r: runs[chunks[0]][r]["tokens"] for r in range(a.rounds)}
    for c in chunks:
        for r, res in enumerate(runs[c]):
            if res.pop("tokens") != ref[r] and c != chunks[0]:
                raise SystemExit(f"chunk {c}, round {r}: tokens differ from chunk {chunks[0]}")
    out = {"benchmark": "serve_join_latency", "model": "SmolLM2-135M-Instruct", "machine": common.machine(),
           "loadavg_end": common.loadavg(), "note": a.note, "warmup_s": warm_s,
           "settings": {"rows": a.rows, "max_batch": a.max_batch, "new": a.new, "prompt": a.prompt,
                        "prefix_cache": a.prefix, "rounds": a.rounds},
           "modes": {str(c): {"itl_p50_s": common.median([x["itl_p50_s"] for x in runs[c]]),
                              "itl_p99_s": common.median([x["itl_p99_s"] for x in runs[c]]),
                              "long_ttft_s": common.median([x["long_ttft_s"] for x in runs[c]]),
                              "rounds": runs[c]} for c in chunks}}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({c: {k: v for k, v in m.items() if k != "rounds"} for c, m in out["modes"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
