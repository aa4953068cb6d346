"""Where does msllm's training step spend its time? Times parts of the step separately, each as
its own compiled graph (GRAPH_MODE), on the benchmark shapes and the real Alpaca batches:

  forward      network(input_ids, labels) -> loss
  fwd+bwd      loss and gradients (GradOperation), no optimizer
  head+loss    the output head matmul + CausalMLLoss alone on (B*T, C) hidden states
  optimizer    nn.AdamWeightDecay on fixed gradients
  step         the whole TrainStep (default: dynamic loss scale + clip) and the noscale variant

and optionally runs ``mindspore.Profiler`` over a few full steps (``--profiler DIR``) and prints
the top operators by total time.

    .venv/bin/python benchmarks/profile_step.py --shape tiny [--repeats 5] [--profiler /tmp/prof]

Wall time and process CPU time (user+sys of all threads) are printed per part: on a loaded
machine wall time swings, CPU time much less.
"""

from __future__ import annotations

import json
import os
import time

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness

common.use_repo()


def timed(fn, repeats):
    """(first call s, median wall s, median cpu s) of fn() (fn must synchronise)."""
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return first, common.median(walls), common.median(cpus)


def op_type_totals(directory: str) -> dict:
    """{operator type: (total ms, calls)} from the newest MindSpore CPU profile under ``directory``
    (``*/FRAMEWORK/cpu_op_type_info_*.csv``), largest first; {} when there is none."""
    import csv
    import glob

    files = sorted(glob.glob(os.path.join(directory, "*", "FRAMEWORK", "cpu_op_type_info_*.csv")),
                   key=os.path.getmtime)
    if not files:
        return {}
    with open(files[-1]) as fh:
        rows = list(csv.DictReader(fh))
    rows.sort(key=lambda r: -float(r["total_compute_time"]))
    return {r["op_type"]: (float(r["total_compute_time"]), int(r["type_occurrences"])) for r in rows}


def summarize_profile(directory: str, steps: int, top: int = 25) -> None:
    """Print MindSpore's CPU profiler totals by operator type (ms per step) from :func:`op_type_totals`."""
    totals = op_type_totals(directory)
    if not totals:
        print("no cpu_op_type_info csv found")
        return
    total = sum(t for t, _ in totals.values())
    print(f"kernel time by operator type, ms per step ({total / steps:.0f} ms in total):")
    for op, (t, calls) in list(totals.items())[:top]:
        print(f"  {op:28s} {t / steps:9.1f} ms  {100 * t / total:5.1f}%  ({calls // steps} calls)")


def main(argv=None):
    p = harness.arg_parser(__doc__, "tiny")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--parts", default="forward,fwdbwd,head,optimizer,step,step_noscale")
    p.add_argument("--jit_level", default="O0")
    p.add_argument("--profiler", default="", help="directory: also run mindspore.Profiler over the step")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--context", default="{}", help="JSON passed to ms.set_context (e.g. graph kernel flags)")
    p.add_argument("--code", default="", help="HEAD or a directory with model.py + step.py to profile "
                   "instead of the working tree (see ab_step.py)")
    p.add_argument("--layout_path", action="store_true",
                   help="build the model's layout path (fast_paths=False); default: the CPU fast path the "
                   "trainer uses on CPU")
    p.add_argument("--kernel_stats", action="store_true",
                   help="time every msllm kernel call (MSLLM_KERNEL_PROFILE=1) and print ms per step by kernel")
    p.add_argument("--model_config", default="{}",
                   help='JSON set on the LlamaConfig, e.g. \'{"cpu_kernels": false}\' (fields not yet in '
                   'LlamaConfig are set as attributes); "compact_loss" goes to the model builder')
    a = p.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    if a.kernel_stats:
        os.environ["MSLLM_KERNEL_PROFILE"] = "1"

    import numpy as np

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.step import TrainStep

    if a.code:
        import tempfile

        import ab_step

        d = ab_step.version_dir(a.code, tempfile.mkdtemp(), "A")
        mfile, sfile = ab_step.files_of(d)
        LlamaForCausalLM = ab_step.load_module(mfile, "model_profiled").LlamaForCausalLM  # noqa: N806
        TrainStep = ab_step.load_module(sfile, "step_profiled").TrainStep  # noqa: N806
        print(f"code: {mfile}, {sfile}")

    s = common.shape(a.shape)
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE, jit_config={"jit_level": a.jit_level}, **json.loads(a.context))
    cfg = common.msllm_model_config(s)
    common.prepare_data(s["seq_length"])
    init = np.load(common.prepare_weights(a.shape))
    ids, lab = common.batches(common.data_file(s["seq_length"]), s["batch_size"], 1)[0]
    ids, lab = Tensor(ids), Tensor(lab)
    tokens = s["batch_size"] * s["seq_length"]

    model_config = json.loads(a.model_config)
    compact = model_config.pop("compact_loss", None)       # a builder argument, not a config field
    for key, value in model_config.items():
        setattr(cfg, key, value)

    def fresh():
        net = LlamaForCausalLM(cfg, compact_loss=compact, fast_paths=not a.layout_path)
        common.set_ms_weights(net.trainable_params(), init)
        return net

    def adamw(net):
        return common.ms_adamw(net.trainable_params(), 1000)

    results = {}
    parts = a.parts.split(",")
    print(f"shape {a.shape}: {s}, jit_level {a.jit_level}, load {common.loadavg()}", flush=True)

    def report(name, r):
        first, wall, cpu = r
        results[name] = {"first_s": first, "wall_s": wall, "cpu_s": cpu, "load": common.loadavg()}
        print(f"{name:14s} first {first:7.2f} s   wall {wall * 1e3:8.1f} ms   cpu {cpu * 1e3:8.1f} ms"
              f"   ({tokens / wall:7.0f} tok/s wall)   load {common.loadavg()}", flush=True)

    if "forward" in parts:
        net = fresh()
        net.set_train(False)

        class Fwd(nn.Cell):
            def __init__(self, n):
                super().__init__()
                self.n = n

            def construct(self, x, y):
                return self.n(x, y)

        f = Fwd(net)
        report("forward", timed(lambda: f(ids, lab).asnumpy(), a.repeats))

    if "fwdbwd" in parts:
        net = fresh()
        net.set_train(True)

        class FwdBwd(nn.Cell):
            def __init__(self, n):
                super().__init__()
                self.n = n
                self.w = ms.ParameterTuple(n.trainable_params())
                self.g = ops.GradOperation(get_by_list=True)

            def construct(self, x, y):
                return self.g(self.n, self.w)(x, y)

        fb = FwdBwd(net)
        report("fwd+bwd", timed(lambda: fb(ids, lab)[0].asnumpy(), a.repeats))

    if "head" in parts:
        net = fresh()
        net.set_train(True)

        class Head(nn.Cell):
            def __init__(self, n):
                super().__init__()
                self.lm_head = n.lm_head
                self.loss = n.loss
                self.w = ms.ParameterTuple(n.lm_head.trainable_params())
                self.g = ops.GradOperation(get_by_list=True)
                self.v = s["vocab_size"]

            def fwd(self, h, y):
                return self.loss(self.lm_head(h).reshape(1, -1, self.v), y)

            def construct(self, h, y):
                return self.g(self.fwd, self.w)(h, y)

        h = Tensor(np.random.default_rng(0).standard_normal((tokens, s["hidden_size"]), np.float32))
        y = lab[:, 1:].reshape(1, -1)
        hd = Head(net)
        report("head+loss f+b", timed(lambda: hd(h, y)[0].asnumpy(), a.repeats))

    if "optimizer" in parts:
        net = fresh()
        opt = adamw(net)
        grads = tuple(Tensor(np.full(q.shape, 1e-3, np.float32)) for q in opt.parameters)

        class Opt(nn.Cell):
            def __init__(self, o):
                super().__init__()
                self.o = o

            def construct(self, g):
                return self.o(g)

        oc = Opt(opt)

        def run_opt():
            oc(grads)
            net.lm_head.weight.asnumpy()

        report("optimizer", timed(run_opt, a.repeats))

    for name, kw in (("step", {}), ("step_noscale", {"loss_scale": "none", "max_grad_norm": None})):
        if name not in parts:
            continue
        net = fresh()
        st = TrainStep(net, adamw(net), **kw)
        st.set_train()
        if a.kernel_stats:
            from msllm.kernels import kernel_stats

            st(ids, lab)[0].asnumpy()                                  # compile outside the counts
            kernel_stats(reset=True)
        report(name, timed(lambda: st(ids, lab)[0].asnumpy(), a.repeats))
        if a.kernel_stats:
            stats = kernel_stats(reset=True)
            steps_run = a.repeats + 1                                   # timed() calls once more first
            total = sum(sec for _, sec in stats.values())
            print(f"  msllm kernels, per step: {1e3 * total / steps_run:.1f} ms in total", flush=True)
            for kname, (calls, sec) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
                print(f"    {kname:32s} {calls / steps_run:6.0f} calls {1e3 * sec / steps_run:9.1f} ms", flush=True)
            results[name]["kernel_ms_per_step"] = {k: 1e3 * sec / steps_run for k, (c, sec) in stats.items()}
        if a.profiler and name == "step":
            prof = ms.Profiler(output_path=a.profiler)
            for _ in range(3):
                st(ids, lab)[0].asnumpy()
            prof.stop()
            prof.analyse()
            print(f"profiler output in {a.profiler}")
            summarize_profile(a.profiler, 3)
    if a.json:
        harness.write_json(a.json, {"shape": a.shape, "jit_level": a.jit_level, "tokens": tokens, "results": results})


if __name__ == "__main__":
    main()
