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

import worker_common as wc  # first: takes the process start time

common = wc.common
common.use_repo()
from msllm.convert.mindformers import msllm_to_mindformers_name  # noqa: E402  (pure Python)


def main():
    args, s, steps, warmup = wc.train_args()
    phases = wc.Phases()
    import mindspore as ms
    from mindspore import Tensor, nn
    import mindformers
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    phases.mark("import")

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
    init = common.np.load(common.prepare_weights(args["shape"]))
    msllm_name = {msllm_to_mindformers_name(k): k for k in init.files}
    common.set_ms_weights(net.trainable_params(), init, lambda n: msllm_name.get(n, "(no msllm name) " + n))
    opt = common.ms_adamw(net.trainable_params(), steps + warmup + 1)

    class WithLabels(nn.Cell):
        def __init__(self, n):
            super().__init__(auto_prefix=False)
            self.n = n

        def construct(self, input_ids, labels):
            return self.n(input_ids, labels)

    step = nn.TrainOneStepCell(WithLabels(net), opt)
    step.set_train(True)
    phases.mark("build")

    def one_step(a, b):
        return float(common.np.asarray(step(a, b).asnumpy()).reshape(-1)[0])

    timing = wc.timed_steps(wc.train_batches(s, warmup + steps), lambda ids, lab: (Tensor(ids), Tensor(lab)),
                            one_step, warmup, s["batch_size"] * s["seq_length"], wc.spawn_time(args), phases.rss)
    common.emit({
        "framework": args.get("name", "mindformers"), "shape": args["shape"], "mindspore": ms.__version__,
        "mindformers": mindformers.__version__, **phases.fields(), **timing,
        "peak_rss_mib": common.peak_rss_mib(),
    })


if __name__ == "__main__":
    main()
