"""MindFormers 1.9.0 training-step worker (runs in benchmarks/.venv-mindformers, MindSpore 2.9.0).

``mindformers.models.llama.LlamaForCausalLM`` (compute/param/softmax/layernorm dtype fp32,
``use_rope_slice=True, fused_rms_norm=False``: the settings that run on CPU, see shared NOTES.md)
+ MindSpore ``nn.TrainOneStepCell`` with ``nn.AdamWeightDecay`` (the same two parameter groups
and hyper-parameters as msllm's trainer), GRAPH_MODE, jit_level O0. MindFormers' own Trainer /
``MFTrainOneStepCell`` cannot run on CPU (overflow check uses ``NPUGetFloatStatusV2``), so there
is no loss scale and no clipping here: compare with msllm's ``noscale`` variant for the losses.

The initial weights are the benchmark's common ones (msllm names, renamed with the table of
``msllm/convert/mindformers.py``).

Usage: python mf_worker.py '{"shape": "tiny", "steps": 20, "warmup": 3, "spawn_time": ...}'
Prints one ``BENCH_RESULT {json}`` line.
"""

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402

sys.path.insert(0, common.ROOT)
from msllm.convert.mindformers import msllm_to_mindformers_name  # noqa: E402  (pure Python)


def main():
    args = json.loads(sys.argv[1])
    spawn = args.get("spawn_time", T_START)
    s = common.shape(args["shape"])
    steps, warmup = args["steps"], args["warmup"]
    np = common.np

    t = time.perf_counter()
    import mindspore as ms
    from mindspore import Tensor, nn
    import mindformers
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    import_s = time.perf_counter() - t
    rss = {"after_import": common.rss_mib()}

    t = time.perf_counter()
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE, jit_config={"jit_level": args.get("jit_level", "O0")})
    if args.get("threads"):
        ms.set_context(runtime_num_threads=int(args["threads"]))
    ms.set_seed(0)
    cfg = LlamaConfig(batch_size=s["batch_size"], seq_length=s["seq_length"], hidden_size=s["hidden_size"],
                      num_layers=s["num_layers"], num_heads=s["num_heads"],
                      intermediate_size=s["intermediate_size"], vocab_size=s["vocab_size"],
                      rms_norm_eps=common.RMS_EPS, compute_dtype="float32", layernorm_compute_type="float32",
                      softmax_compute_type="float32", rotary_dtype="float32", param_init_type="float32",
                      use_rope_slice=True, fused_rms_norm=False, use_flash_attention=False,
                      use_past=False, pad_token_id=0, ignore_token_id=-100)
    net = LlamaForCausalLM(cfg)
    net.set_train(True)
    init = np.load(common.prepare_weights(args["shape"]))
    params = {p.name: p for p in net.trainable_params()}
    mapped = {msllm_to_mindformers_name(k): k for k in init.files}
    assert set(params) == set(mapped), sorted(set(params) ^ set(mapped))[:6]
    for name, p in params.items():
        p.set_data(Tensor(init[mapped[name]]))
    o = common.OPTIM
    decay = [p for p in net.trainable_params() if p.ndim >= 2]
    no_decay = [p for p in net.trainable_params() if p.ndim < 2]
    lr = Tensor(np.full(steps + warmup + 1, o["lr"], np.float32))
    opt = nn.AdamWeightDecay([{"params": decay, "weight_decay": o["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             learning_rate=lr, beta1=o["beta1"], beta2=o["beta2"], eps=o["eps"])

    class WithLabels(nn.Cell):
        def __init__(self, n):
            super().__init__(auto_prefix=False)
            self.n = n

        def construct(self, input_ids, labels):
            return self.n(input_ids, labels)

    step = nn.TrainOneStepCell(WithLabels(net), opt)
    step.set_train(True)
    build_s = time.perf_counter() - t
    rss["after_build"] = common.rss_mib()

    data = common.batches(common.data_file(s["seq_length"]), s["batch_size"], warmup + steps)
    losses, times, cpus = [], [], []
    first_step_s = startup_to_first_step = None
    for i, (ids, lab) in enumerate(data):
        a, b = Tensor(ids), Tensor(lab)
        c0, t = time.process_time(), time.perf_counter()
        loss = step(a, b)
        lv = float(np.asarray(loss.asnumpy()).reshape(-1)[0])
        dt = time.perf_counter() - t
        cpus.append(time.process_time() - c0)
        if i == 0:
            rss["after_first_step"] = common.rss_mib()
            first_step_s = dt
            startup_to_first_step = time.time() - spawn
        losses.append(lv)
        times.append(dt)
    med = common.median(times[warmup:])
    tokens = s["batch_size"] * s["seq_length"]
    common.emit({
        "framework": "mindformers", "shape": args["shape"], "mindspore": ms.__version__,
        "mindformers": mindformers.__version__, "import_s": import_s, "build_s": build_s,
        "first_step_s": first_step_s, "startup_to_first_step_s": startup_to_first_step,
        "step_s_median": med, "step_s_all": times, "cpu_s_median": common.median(cpus[warmup:]),
        "tokens_per_s": tokens / med, "losses": losses, "peak_rss_mib": common.peak_rss_mib(), "rss_mib": rss,
    })


if __name__ == "__main__":
    main()
