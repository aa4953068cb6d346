#!/usr/bin/env python
"""Peak resident memory of HF <-> msllm weight conversion on a random model of a few hundred MB.

    python benchmarks/convert_peak_rss.py [--hidden 1024 --layers 8 --vocab 32000 --ffn 2816] [--dtype bf16]

Each measurement runs in a fresh process: after its imports it records its RSS (the baseline),
resets the kernel's peak counter (``/proc/self/clear_refs`` = 5) and reports ``VmHWM`` (the peak
RSS, ``/proc/self/status``) after the conversion. "delta" = peak - baseline is the memory the
conversion itself needed, to compare with the model size and its largest tensor (Linux only;
``ru_maxrss`` is not used because a forked child inherits the parent's high-water mark). A streaming conversion needs about one tensor
(plus its dtype-cast copy), not the model.

Also measured for contrast: the non-streaming way (``mindspore.load_checkpoint`` of the msllm
checkpoint, which holds every tensor at once).

Writes ``benchmarks/results/convert_peak_rss.json`` (``--out``): the model, each run's baseline,
peak and delta (MiB), the machine and the load average. The model files go to a temporary
directory that is removed afterwards (``--workdir`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})

def status(key):  # kB, from /proc/self/status: VmRSS now, VmHWM = peak since exec or last reset
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith(key + ":"))

import numpy, tqdm, yaml
from msllm.convert import hf
from msllm.training import checkpoint
mode, a, b = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "ms_load":
    import mindspore as ms
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:  # reset VmHWM to the current RSS
    fh.write("5")
t0 = time.perf_counter()
if mode == "hf2ms":
    hf.convert_hf_to_msllm(a, b, progress=False)
elif mode == "hf2ms_bf16":
    hf.convert_hf_to_msllm(a, b, dtype="bf16", progress=False)
elif mode == "ms2hf":
    hf.convert_msllm_to_hf(a, b, progress=False)
elif mode == "ms_load":
    params = ms.load_checkpoint(a)
print(json.dumps({{"baseline_kb": base, "peak_kb": status("VmHWM"), "seconds": time.perf_counter() - t0}}))
"""


def child(mode: str, a: str = "", b: str = "") -> dict:
    code = CHILD.format(root=ROOT)
    r = subprocess.run([sys.executable, "-c", code, mode, a, b], capture_output=True, text=True,
                       env=dict(os.environ, GLOG_v="3"))
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    import common  # benchmarks/common.py, harness.py (imported here: tests import child() from this module)
    import harness

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--workdir", default=None, help="where to put the model files (default: a temp dir, removed)")
    p.add_argument("--out", default=os.path.join(common.HERE, "results", "convert_peak_rss.json"))
    args = p.parse_args(argv)

    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="msllm_convert_bench_") as tmp:
        result = measure(args, args.workdir or tmp)
    result.update(machine=common.machine(), command=harness.command_line())
    rows = result["runs"]
    table = [f"{'run':38s} {'baseline MiB':>12s} {'peak MiB':>9s} {'delta MiB':>10s} {'delta/model':>12s} {'s':>6s}"]
    table += [f"{r['mode']:38s} {r['baseline_mib']:12.0f} {r['peak_mib']:9.0f} {r['delta_mib']:10.0f} "
              f"{r['delta_over_model']:12.2f} {r['seconds']:6.1f}" for r in rows]
    harness.finish(args.out, result, "\n".join(table), t_start)
    return 0


def measure(args, work: str) -> dict:
    """Write the random HF model into ``work`` and measure every conversion in a fresh process."""
    import common

    from msllm.convert import hf
    from msllm.convert.verify import write_random_hf_dir

    hf_dir, ckpt, back = (os.path.join(work, x) for x in ("hf", "model.ckpt", "hf_back"))
    t0 = time.perf_counter()
    cfg = write_random_hf_dir(hf_dir, seed=0, dtype=args.dtype, vocab_size=args.vocab, hidden_size=args.hidden,
                              intermediate_size=args.ffn, num_hidden_layers=args.layers,
                              num_attention_heads=args.heads, max_position_embeddings=2048)
    mcfg = hf.hf_config_to_msllm(cfg)
    shapes = hf.param_shapes(mcfg)
    sizes = [hf.tensor_nbytes(s, args.dtype) for s in shapes.values()]
    model_mb, largest_mb = sum(sizes) / 2**20, max(sizes) / 2**20
    print(f"model: {mcfg.num_params() / 1e6:.1f}M parameters, {args.dtype}, {model_mb:.0f} MiB; "
          f"largest tensor {largest_mb:.0f} MiB (written in {time.perf_counter() - t0:.1f}s to {work})", flush=True)

    rows = []
    for mode, a, b in (("hf2ms", hf_dir, ckpt), ("ms2hf", ckpt, back),
                       ("hf2ms_bf16", hf_dir, os.path.join(work, "model_bf16.ckpt")),
                       ("mindspore.load_checkpoint (contrast)", ckpt, "")):
        load = common.loadavg()
        try:
            r = child("ms_load" if mode.startswith("mindspore") else mode, a, b)
        except RuntimeError as exc:
            print(f"{mode}: failed: {str(exc).strip().splitlines()[-1][:300]}")
            rows.append({"mode": mode, "error": str(exc)[-2000:], "load": load})
            continue
        base, peak = r["baseline_kb"] / 1024, r["peak_kb"] / 1024
        rows.append({"mode": mode, "baseline_mib": base, "peak_mib": peak, "delta_mib": peak - base,
                     "delta_over_model": (peak - base) / model_mb, "delta_over_largest": (peak - base) / largest_mb,
                     "seconds": r["seconds"], "load": load})
    return {"model": {"params": mcfg.num_params(), "dtype": args.dtype, "hidden_size": args.hidden,
                      "num_layers": args.layers, "num_heads": args.heads, "vocab_size": args.vocab,
                      "intermediate_size": args.ffn, "model_mib": model_mb, "largest_tensor_mib": largest_mb},
            "runs": [r for r in rows if "error" not in r], "errors": [r for r in rows if "error" in r]}


if __name__ == "__main__":
    sys.exit(main())
