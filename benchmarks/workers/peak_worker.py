"""Best fp32 matmul rate on this machine, for MFU: MindSpore's MatMul (what msllm's trainer uses
as the CPU peak: ``msllm.training.throughput.measure_cpu_peak_tflops``), PyTorch (2 threads) and
numpy's BLAS (as configured in this environment: OPENBLAS_CORETYPE, if set, slows it down).

Usage: python peak_worker.py '{"n": 2048, "repeats": 5, "which": ["mindspore", "torch", "numpy"]}'
Prints one ``BENCH_RESULT {json}`` line with GFLOP/s per library (2 n^3 FLOPs per matmul, best
of ``repeats`` after one warm-up).
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402

common.use_repo()


def best(fn, repeats):
    fn()
    b = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t)
    return b


def main():
    args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    n, repeats = args.get("n", 2048), args.get("repeats", 5)
    which = args.get("which", ["mindspore", "torch", "numpy"])
    np = common.np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    flops = 2.0 * n ** 3
    out = {"n": n, "load": common.loadavg(),
           "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
           "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE")}
    if "numpy" in which:
        out["numpy_gflops"] = flops / best(lambda: a @ b, repeats) / 1e9
    if "torch" in which:
        import torch
        torch.set_num_threads(2)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        out["torch_gflops"] = flops / best(lambda: ta @ tb, repeats) / 1e9
    if "mindspore" in which:
        import mindspore as ms
        from mindspore import ops
        ms.set_device("CPU")
        ma, mb = ms.Tensor(a), ms.Tensor(b)
        mm = ops.MatMul()
        out["mindspore_gflops"] = flops / best(lambda: mm(ma, mb).asnumpy(), repeats) / 1e9
        from msllm.training.throughput import measure_cpu_peak_tflops
        out["msllm_measure_cpu_peak_gflops"] = measure_cpu_peak_tflops(n, repeats) * 1e3
    common.emit(out)


if __name__ == "__main__":
    main()
