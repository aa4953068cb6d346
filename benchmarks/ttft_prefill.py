"""Time to first token on the real SmolLM2-135M, before and after the prefill change: the KV-cache
write by concatenation instead of a one-hot matmul (``write^T @ new``, O(T S K D) per layer) and
the prefill's attention over the prompt's own keys instead of every slot of the buffer, with the
cache buffer chat uses (the whole context window, 8192 slots) and the one predict uses (prompt +
new tokens, rounded up).

    .venv/bin/python benchmarks/ttft_prefill.py [--rounds 3] [--out benchmarks/results/ttft_prefill.json]

Each (variant, buffer, prompt length) runs in its own process, variants alternating within a round;
the figure is the prefill's wall time on its second call (the first compiles), median over rounds.
The "before" variant patches the previous code (kept below) into the same model. That patch
fits the functional (B, K, S, D) cache the model had until commit 0a84e00; since the cache is
written in place (msllm/models/llama/kv_cache.py) it no longer does, so this script runs only in
a checkout of 0a84e00 or earlier (``git worktree add /tmp/old 0a84e00``), where its result file
``benchmarks/results/ttft_prefill.json`` was made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402


def _previous_code():
    """Patch in the prefill of the commit before this change: the one-hot matmul write
    (``write^T @ new``, O(T S K D) per layer) and attention over every slot of the buffer."""
    from mindspore import ops

    from msllm.models.llama import kv_cache, model

    if hasattr(kv_cache.KVCache, "heads_first"):   # the in-place cache: see the module docstring
        raise SystemExit("benchmarks/ttft_prefill.py patches the functional KV cache of commit 0a84e00 and "
                         "earlier; run it in a checkout of that commit (git worktree add /tmp/old 0a84e00)")

    init = kv_cache.KVCache.__init__

    def __init__(self):
        init(self)
        self.matmul = ops.MatMul(transpose_a=True)
        self.reduce_sum = ops.ReduceSum(keep_dims=False)
        self.transpose = ops.Transpose()

    def construct(self, cache, new, write, fresh=False):
        b, k, s, d = cache.shape
        t = new.shape[2]
        if t == 1:
            hit = self.reshape(write, (1, 1, s, 1)) > 0.5
            return ops.where(hit, new, cache)
        write = self.cast(write, cache.dtype)
        keep = 1.0 - self.reduce_sum(write, 0)
        flat = self.reshape(self.transpose(new, (2, 0, 1, 3)), (t, b * k * d))
        placed = self.reshape(self.matmul(write, flat), (s, b, k, d))
        placed = self.transpose(placed, (1, 2, 0, 3))
        return cache * self.reshape(keep, (1, 1, s, 1)) + placed

    def construct_cached(self, x, cos, sin, mask, k_cache, v_cache, write, fresh=False):
        q, k, v = self.project(x, cos, sin)
        k_cache = self.kv_cache(k_cache, k, write)
        v_cache = self.kv_cache(v_cache, v, write)
        return self.attend(q, k_cache, v_cache, mask), k_cache, v_cache

    kv_cache.KVCache.__init__, kv_cache.KVCache.construct = __init__, construct
    model.Attention.construct_cached = construct_cached


def worker(variant: str, buffer: int, prompt_len: int) -> dict:
    import numpy as np

    from msllm.config import load_config
    from msllm.convert.real_model import ensure_smollm2
    from msllm.generation.loading import load_for_inference

    if variant == "before":
        _previous_code()
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    cfg = load_config(os.path.join(ROOT, "configs", "smollm2", "run_smollm2_135m.yaml"),
                      [f"--load_checkpoint={ensure_smollm2()}"])
    net, mc, _ = load_for_inference(cfg)
    from msllm.generation.decode import generator_for

    gen = generator_for(net, mc)
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, 40000, prompt_len)]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        logits, caches, _ = gen.prefill([prompt], prompt_len, buffer, 0)
        float(logits[0, 0])
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "buffer": buffer, "prompt": prompt_len, "first_s": times[0],
            "ttft_s": min(times[1:]), "times": times, "argmax": int(np.argmax(logits[0]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results", "ttft_prefill.json"))
    p.add_argument("--worker", nargs=3, metavar=("VARIANT", "BUFFER", "PROMPT"))
    a = p.parse_args()
    if a.worker:
        print("BENCH_RESULT " + json.dumps(worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))), flush=True)
        return
    start = time.time()
    runs = []
    cases = [(8192, 64), (8192, 512), (640, 512)]
    for r in range(a.rounds):
        for buffer, prompt in cases:
            for variant in ("before", "after"):
                load = os.getloadavg()[0]
                out = subprocess.run([sys.executable, __file__, "--worker", variant, str(buffer), str(prompt)],
                                     capture_output=True, text=True, timeout=1800, env=dict(os.environ, GLOG_v="3"))
                line = [x for x in out.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
                row = json.loads(line[-1][13:]) if line else {"error": out.stderr[-2000:]}
                row.update(round=r, load_before=load, variant=variant, buffer=buffer, prompt=prompt)
                runs.append(row)
                print(row, flush=True)
    table = {}
    for buffer, prompt in cases:
        for variant in ("before", "after"):
            ts = sorted(x["ttft_s"] for x in runs if x.get("variant") == variant and x["buffer"] == buffer
                        and x["prompt"] == prompt and "ttft_s" in x)
            if ts:
                table[f"{variant} buffer {buffer} prompt {prompt}"] = {"min": ts[0], "median": ts[len(ts) // 2],
                                                                        "max": ts[-1]}
    summary = {"runs": runs, "table": table, "machine": common.machine(), "command": harness.command_line(),
               "seconds": time.time() - start}
    harness.write_json(a.out, summary)
    for k, v in table.items():
        print(f"| {k} | {v['median']:.3f} s ({v['min']:.3f}-{v['max']:.3f}) |")


if __name__ == "__main__":
    main()
