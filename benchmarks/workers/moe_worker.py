"""Mixture-of-experts training-step worker (issue #22): one framework on a Mixtral-like shape
(``common.SHAPES["moe-tiny-e*"]``) from the same random transformers Mixtral directory
(``common.moe_hf_dir``), on the common Alpaca data, AdamW with MindSpore semantics, the
load-balancing loss in the training loss.

* ``framework: msllm``: the network, optimizer and train step as ``msllm.training.setup`` builds
  them for ``load_checkpoint`` = the HF directory (``adopt_hf_model_config``, ``build_network``,
  ``load_base_into``), GRAPH_MODE, msllm's CPU kernels (the grouped dropless dispatch), the
  compact loss (the output head only at positions with a target); ``dense_head: true``: the head
  at every position, the same work as transformers.
* ``framework: torch``: transformers' ``MixtralForCausalLM`` (eager, which loops over the experts
  in Python), ``output_router_logits`` on, ``common.OPTIM``'s AdamW (``worker_common.torch_adamw``).

Usage: python moe_worker.py '{"shape": "moe-tiny-e8", "framework": "msllm", "steps": 12, "warmup": 2}'
Prints one ``BENCH_RESULT {json}`` line.
"""

import worker_common as wc  # first: takes the process start time

common = wc.common


def run_msllm(args, s, steps, warmup, phases, hf):
    import mindspore as ms
    from mindspore import Tensor

    common.use_repo()
    from msllm.cluster.context import setup_runtime
    from msllm.convert.starting import load_base_into
    from msllm.training.setup import build_network, build_optimizer, build_train_step
    from msllm.training.sources import adopt_hf_model_config

    cfg = wc.msllm_run_config(s, [f"--load_checkpoint={hf}", "--run_mode=finetune"])
    rt = setup_runtime(cfg)
    cfg = adopt_hf_model_config(cfg)
    if args.get("dense_head"):   # like for like: the output head at every position, as transformers
        from msllm.models.llama.model import LlamaForCausalLM

        net = LlamaForCausalLM(cfg.model_config, compact_loss=False, fast_paths=cfg.fast_paths)
        net.return_router_stats(True)
    else:
        net, _ = build_network(cfg, rt, sharded=False)
    load_base_into(net, hf, 0)
    lr = common.np.full(steps + warmup + 1, common.OPTIM["lr"], common.np.float32)
    step = build_train_step(net, build_optimizer(net, cfg, lr), cfg, rt)
    phases.mark("build")

    def one_step(a, b):
        return float(step(a, b)[0].asnumpy())

    timing = wc.timed_steps(wc.train_batches(s, warmup + steps), lambda ids, lab: (Tensor(ids), Tensor(lab)),
                            one_step, warmup, s["batch_size"] * s["seq_length"], wc.spawn_time(args), phases.rss)
    return {"mindspore": ms.__version__, "kernels": net.kernels.describe(), "compact_loss": bool(net.compact_loss),
            "grouped_experts": bool(net.model.layers[0].mlp.grouped), **timing}


def run_torch(args, s, steps, warmup, phases, hf):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(args.get("threads", 2)))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa")
    model.config.output_router_logits = True
    model.train()
    opt_step, _ = wc.torch_adamw(torch, [p for p in model.parameters() if p.requires_grad])
    phases.mark("build")

    def one_step(tokens, targets):
        out = model(input_ids=tokens, labels=targets, shift_labels=targets, output_router_logits=True)
        out.loss.backward()
        opt_step()
        model.zero_grad(set_to_none=True)
        return float(out.loss)

    timing = wc.timed_steps(wc.train_batches(s, warmup + steps), lambda ids, lab: wc.torch_targets(torch, ids, lab),
                            one_step, warmup, s["batch_size"] * s["seq_length"], wc.spawn_time(args), phases.rss)
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), **timing}


def main():
    args, s, steps, warmup = wc.train_args()
    phases = wc.Phases()
    hf = common.moe_hf_dir(args["shape"])
    phases.mark("import")
    run = run_msllm if args["framework"] == "msllm" else run_torch
    res = run(args, s, steps, warmup, phases, hf)
    common.emit({"framework": args["framework"], "shape": args["shape"], **phases.fields(), **res,
                 "peak_rss_mib": common.peak_rss_mib()})


if __name__ == "__main__":
    main()
