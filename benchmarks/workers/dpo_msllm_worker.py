"""msllm DPO training-step worker for benchmarks/dpo_speed.py: the run of ``run_msllm.py --run_mode finetune``
with a ``dpo`` section (msllm.training.setup ``prepare`` / ``load_start``: SmolLM2 from its HF directory,
GRAPH_MODE, AdamW, the run YAML's clipping), on the benchmark's preference MindRecord, batches in file order.

Usage: python dpo_msllm_worker.py '{"hf_dir": ..., "config": ..., "data": X.mindrecord, "seq": 128,
        "batch": 2, "steps": 4, "warmup": 1, "lora": false, "precompute_ref": false, "name": ..., "spawn_time": ...}'

Each batch is cut to its longest pair as the training loop does on CPU (``msllm.training.dpo.cut_pair_batch``,
``msllm/training/loop.py``: widths 32 / 64 / 128 / ... / seq, one compiled graph each). Timed: the train step call
only (``step_cell(*batch)`` up to the loss on the host); the first ``warmup`` steps and every step that is the
first at its width (it compiles that width's graph: a cost paid once per width in a run, reported as
``compile_steps``) are excluded from the median. Tokens of a step: every chosen and rejected sequence's prompt + completion tokens (up to
its last target; padding not counted), the count TRL's attention mask gives. Prints one ``BENCH_RESULT {json}``
line: tokens/s and pairs/s (over the median step), step seconds, first step seconds, peak RSS (VmHWM, MiB).
"""

import os
import sys
import time

import worker_common as wc  # first: takes the process start time

common = wc.common
np = common.np


def real_tokens(labels) -> int:
    """Prompt + completion tokens of (B, 2, L) labels: per sequence, its length n = the index of its last
    target + 1 (the n tokens TRL's attention mask counts; msllm feeds n - 1 of them and predicts n - 1)."""
    lab = np.asarray(labels).reshape(-1, np.asarray(labels).shape[-1])
    last = np.array([np.nonzero(r != -100)[0].max() for r in lab])
    return int((last + 1).sum())


def main():
    args = wc.worker_args()
    common.use_repo()
    from msllm.config import load_config
    from msllm.training.dpo import cut_pair_batch
    from msllm.training.setup import load_start, prepare

    import dpo_speed   # benchmarks/dpo_speed.py: the run's overrides (it imports no msllm module)

    cfg = load_config(args["config"], dpo_speed.msllm_overrides(
        args["hf_dir"], args["data"], args["seq"], args["batch"], args["steps"] + args["warmup"],
        os.path.join(os.getcwd(), "out"), lora=args["lora"], precompute_ref=args.get("precompute_ref"),
        bf16=args.get("bf16")))
    t0 = time.perf_counter()
    run = prepare(cfg)
    load_start(run)   # starting weights (and the precomputed reference, if asked)
    setup_s = time.perf_counter() - t0
    times, tokens, losses, widths, compiles = [], [], [], [], []
    for i, batch in enumerate(run.data.epoch_batches(0)):
        if i == args["steps"] + args["warmup"]:
            break
        batch = cut_pair_batch(batch, cfg.model_config.ignore_token_id, run.agree)
        width = int(batch[0].shape[-1]) - 1
        if width not in widths:
            compiles.append(i)
        widths.append(width)
        t = time.perf_counter()
        loss = float(run.step_cell(*batch)[0].asnumpy())
        times.append(time.perf_counter() - t)
        tokens.append(real_tokens(batch[1].asnumpy()))
        losses.append(loss)
        print(f"step {i + 1}: width {width}, {times[-1]:.2f} s, loss {loss:.4f}", file=sys.stderr, flush=True)
    timed = [i for i in range(args["warmup"], len(times)) if i not in compiles]
    if not timed:
        raise SystemExit("every step compiled a new width: raise --steps")
    step_s = common.median([times[i] for i in timed])
    common.emit({"name": args["name"], "setup_s": setup_s, "first_step_s": times[0], "step_s_median": step_s,
                 "step_s": times, "tokens": tokens, "losses": losses, "widths": widths, "compile_steps": compiles,
                 "timed_steps": timed,
                 "tokens_per_s": float(np.mean([tokens[i] for i in timed])) / step_s, "pairs_per_s": args["batch"] / step_s,
                 "peak_rss_mib": common.peak_rss_mib()})


if __name__ == "__main__":
    main()
