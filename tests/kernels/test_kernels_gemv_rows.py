"""The weight-streaming products (decoding's y = x W^T for 1-8 rows of x: float32 / bfloat16 weights in
``csrc/linear.cc`` and ``csrc/gemv_avx2.cc``, int8 in ``csrc/linear_int8.cc``) stream 8 weight rows at once
(float32 weights on AMD cores) or 2 (``stream_rows_at_once`` in stream.h; MSLLM_GEMV_ROWS forces one for every
weight type):
both give the same bits and float64's product; so does every software prefetch distance
(``stream_prefetch``: MSLLM_GEMV_PREFETCH into L1, MSLLM_GEMV_PREFETCH_FAR into L2; 0 = none), either split
of a product's rows between the threads (``for_row_chunks``, MSLLM_GEMV_SPLIT) and any thread count. The
library is called through ctypes in a subprocess (no MindSpore), so both row counts run on every machine:
on the AVX-512 path at 1-2 rows of x, on the AVX2 path (a CPU without AVX-512, e.g. AMD Zen 3) at one row of x
(8 rows there keep each output's two accumulator chains, so the same bits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from kerneltest_helpers import close, seeded_rng

SEED = 20261128
HERE = os.path.dirname(os.path.abspath(__file__))
# (rows of x, in, out): odd outputs and input tails, chunks that are not multiples of 8, SmolLM2's shapes
SHAPES = [(1, 200, 1001), (2, 37, 51), (1, 576, 192), (2, 576, 1536), (3, 576, 1537), (1, 1536, 576), (8, 64, 70),
          (1, 64, 4099)]

CHILD = r"""
import ctypes, json, sys
import numpy as np
sys.path.insert(0, {here!r})
from kerneltest_helpers import call_aot
from msllm.kernels import library_path
lib = ctypes.CDLL(library_path())
spec = json.loads(sys.argv[1])
assert lib.msllm_gemv_isa() in (1, 2), lib.msllm_gemv_isa()   # a streaming path: AVX-512 or AVX2
assert lib.msllm_gemv_rows() == int(spec["rows"]), lib.msllm_gemv_rows()
for i, (m, n_in, n_out, kind) in enumerate(spec["cases"]):
    x = np.load(spec["dir"] + f"/x{{i}}.npy")
    w = np.load(spec["dir"] + f"/w{{i}}.npy")
    y = np.zeros((m, n_out), np.float32)
    if kind.startswith("int8"):
        s = np.load(spec["dir"] + f"/s{{i}}.npy")
        group = np.array([float(n_in if s.shape[1] == 1 else 32)], np.float32)
        assert call_aot(lib, "msllm_linear_int8", [x, w, s, group], [y]) == 0
    else:
        assert call_aot(lib, "msllm_linear", [x, w], [y]) == 0
    np.save(spec["dir"] + f"/y{{i}}_{{spec['tag']}}.npy", y)
"""


def test_streaming_eight_or_two_weight_rows_at_once_gives_the_same_bits(tmp_path):
    r = seeded_rng(SEED)
    cases, refs = [], []
    for i, (m, n_in, n_out) in enumerate(SHAPES):
        for kind in ("f32", "bf16", "int8-row", "int8-group32"):
            k = len(cases)
            x = r.standard_normal((m, n_in)).astype(np.float32)
            w = (r.standard_normal((n_out, n_in)) * 0.1).astype(np.float32)
            if kind == "bf16":   # bfloat16 weights as their bits; the reference on the values they hold
                bits = (w.view(np.uint32) >> 16).astype(np.uint16)
                w_val = (bits.astype(np.uint32) << 16).view(np.float32)
                np.save(tmp_path / f"w{k}.npy", bits)
            elif kind.startswith("int8"):   # int8 weights, one scale per row or per group of 32 inputs
                q = r.integers(-127, 128, (n_out, n_in)).astype(np.int8)
                groups = 1 if kind == "int8-row" else -(-n_in // 32)
                s = (r.random((n_out, groups)) * 0.01 + 1e-3).astype(np.float32)
                np.save(tmp_path / f"w{k}.npy", q)
                np.save(tmp_path / f"s{k}.npy", s)
                width = n_in if groups == 1 else 32
                w_val = q.astype(np.float64) * np.repeat(s.astype(np.float64), width, axis=1)[:, :n_in]
            else:
                w_val = w
                np.save(tmp_path / f"w{k}.npy", w)
            np.save(tmp_path / f"x{k}.npy", x)
            cases.append((m, n_in, n_out, kind))
            refs.append(x.astype(np.float64) @ w_val.astype(np.float64).T)
    child = CHILD.format(here=HERE)
    # (tag, rows at once, other settings): the prefetch distance in bytes, how a product's rows are split
    # between the threads (each thread a contiguous share, taking the others' leftovers from their backs; or
    # chunks handed out one by one), and 7 threads on this machine's cores (threads descheduled mid-product:
    # shares are taken over by the others)
    runs = (("2", "2", {}), ("8", "8", {}), ("8-noprefetch", "8", {"MSLLM_GEMV_PREFETCH": "0"}),
            ("2-prefetch64", "2", {"MSLLM_GEMV_PREFETCH": "64"}), ("2-chunks", "2", {"MSLLM_GEMV_SPLIT": "chunks"}),
            ("2-nofar", "2", {"MSLLM_GEMV_PREFETCH_FAR": "0"}),
            ("8-far128", "8", {"MSLLM_GEMV_PREFETCH_FAR": "128"}),
            ("2-7threads", "2", {"MSLLM_KERNEL_THREADS": "7"}),
            ("8-7threads-chunks", "8", {"MSLLM_KERNEL_THREADS": "7", "MSLLM_GEMV_SPLIT": "chunks"}))
    for tag, rows, settings in runs:
        env = dict(os.environ, MSLLM_GEMV_ROWS=rows)
        for var in ("MSLLM_GEMV_ISA", "MSLLM_NO_GEMV", "MSLLM_GEMV_PREFETCH", "MSLLM_GEMV_PREFETCH_FAR",
                    "MSLLM_GEMV_SPLIT", "MSLLM_KERNEL_THREADS"):
            env.pop(var, None)
        env.update(settings)
        spec = {"dir": str(tmp_path), "rows": rows, "tag": tag, "cases": cases}
        p = subprocess.run([sys.executable, "-c", child, json.dumps(spec)], env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
    for k, ref in enumerate(refs):
        ys = {tag: np.load(tmp_path / f"y{k}_{tag}.npy") for tag, _, _ in runs}
        for tag in ys:
            np.testing.assert_array_equal(ys[tag], ys["8"], err_msg=f"case {cases[k]}, run {tag}")
        close(ys["8"], ref)


@pytest.mark.parametrize("var", ["MSLLM_GEMV_PREFETCH", "MSLLM_GEMV_PREFETCH_FAR"])
def test_a_malformed_prefetch_distance_is_refused_by_name(monkeypatch, var):
    from msllm.errors import MsllmError
    from msllm.kernels import library_path

    for bad in ("-1", "8k", "1.5"):
        monkeypatch.setenv(var, bad)
        with pytest.raises(MsllmError, match=var + r"='.*': expected a non-negative integer"):
            library_path()
    monkeypatch.setenv(var, "4096")
    assert library_path().endswith(".so")


def test_a_malformed_split_is_refused_by_name(monkeypatch):
    from msllm.errors import MsllmError
    from msllm.kernels import library_path

    for bad in ("chunk", "dynamic", "1"):
        monkeypatch.setenv("MSLLM_GEMV_SPLIT", bad)
        with pytest.raises(MsllmError, match=r"MSLLM_GEMV_SPLIT='.*': expected 'ranges' .* or 'chunks'"):
            library_path()
    for good in ("", "ranges", "chunks"):
        monkeypatch.setenv("MSLLM_GEMV_SPLIT", good)
        assert library_path().endswith(".so")
