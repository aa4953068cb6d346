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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--workdir", default=None, help="where to put the model files (default: a temp dir)")
    args = p.parse_args(argv)

    from msllm.convert import hf
    from msllm.convert.verify import write_random_hf_dir

    work = args.workdir or tempfile.mkdtemp(prefix="msllm_convert_bench_")
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
          f"largest tensor {largest_mb:.0f} MiB (written in {time.perf_counter() - t0:.1f}s to {work})")

    rows = []
    for mode, a, b in (("hf2ms", hf_dir, ckpt), ("ms2hf", ckpt, back),
                       ("hf2ms_bf16", hf_dir, os.path.join(work, "model_bf16.ckpt")),
                       ("mindspore.load_checkpoint (contrast)", ckpt, "")):
        try:
            r = child("ms_load" if mode.startswith("mindspore") else mode, a, b)
        except RuntimeError as exc:
            print(f"{mode}: failed: {str(exc).strip().splitlines()[-1][:300]}")
            continue
        rows.append((mode, r["baseline_kb"] / 1024, r["peak_kb"] / 1024, r["seconds"]))
    print(f"{'run':38s} {'baseline MiB':>12s} {'peak MiB':>9s} {'delta MiB':>10s} {'delta/model':>12s} {'s':>6s}")
    for mode, base, peak, sec in rows:
        print(f"{mode:38s} {base:12.0f} {peak:9.0f} {peak - base:10.0f} {(peak - base) / model_mb:12.2f} {sec:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
