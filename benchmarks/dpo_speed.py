"""DPO training throughput: msllm against TRL 1.16's ``DPOTrainer`` on SmolLM2-135M-Instruct, the same
preference pairs and sequence length, full fine-tuning and LoRA (r 8, alpha 16, q/k/v/o, no dropout), and peak
RSS of each (issue #33: "DPO tokens/s at least 1.5x TRL's DPOTrainer ..., LoRA and full; peak RSS stated against
TRL's").

Pairs: benchmarks/dpo_pairs.py (bundled Alpaca records: chosen = a record's answer, rejected = the next
record's), TRL conversational records; msllm reads them through ``llama_preprocess.py --dataset_type dpo``'s code
(SmolLM2's chat template, rows of seq + 1, TRL's tokenization: tests/training/test_dpo_trl.py), TRL tokenizes them
itself with ``max_length`` = seq + 1. Both in fp32, beta 0.1, sigmoid loss, batch ``--batch`` pairs, AdamW,
gradient clipping at 1.0, one process each (torch: 2 threads).

Variants (each its own subprocess, alternating within every round, ``--rounds``):
``msllm-full`` (frozen reference copy in the step), ``trl-full`` (TRL's default reference copy),
``msllm-lora`` / ``trl-lora`` (reference = the base without adapters on both sides), and with ``--precompute``
also ``msllm-full-pre`` / ``trl-full-pre`` (``dpo.precompute_ref`` / ``precompute_ref_log_probs``: no reference
model during training); with ``--bf16`` also ``msllm-{full,lora}-bf16`` / ``trl-{full,lora}-bf16``: the matmuls in
bfloat16 on both sides, float32 parameters (msllm ``compute_dtype: bfloat16``: its CPU kernels round the GEMMs'
inputs to bfloat16, float32 sums; TRL ``bf16=True``: PyTorch's CPU autocast); ``--only_bf16`` runs those alone.

tokens/s = the mean real tokens of a timed step (prompt + completion of chosen and rejected, padding not counted;
TRL pads each batch to its longest pair, msllm cuts it to its longest pair rounded up to 32 / 64 / 128 / ... / seq
as its training loop does on CPU) / the median timed step (after ``--warmup`` steps; msllm's steps that are the
first at their width compile that width's graph and are left out of the median, listed as ``compile_steps``). What is timed differs slightly: msllm's whole train step (forward, backward, AdamW update);
TRL's ``training_step`` (forward, backward; its optimizer step is outside). Ratios msllm / TRL are per-round paired
(``benchmarks/ratios.py``).

    python benchmarks/dpo_speed.py --rounds 3 --steps 6 --precompute     # the figure
    python benchmarks/dpo_speed.py --rounds 1 --steps 2 --warmup 1       # a quick check

Writes ``benchmarks/results/dpo_speed.json`` (with the machine, its load and every run) and prints a table.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import dpo_pairs  # noqa: E402
import harness  # noqa: E402
import ratios  # noqa: E402

CONFIG = "configs/smollm2/run_smollm2_135m.yaml"
VARIANTS = {  # name: (worker, lora, precomputed reference, bf16 compute)
    "msllm-full": ("dpo_msllm_worker.py", False, False, False), "trl-full": ("dpo_trl_worker.py", False, False, False),
    "msllm-lora": ("dpo_msllm_worker.py", True, False, False), "trl-lora": ("dpo_trl_worker.py", True, False, False),
    "msllm-full-pre": ("dpo_msllm_worker.py", False, True, False), "trl-full-pre": ("dpo_trl_worker.py", False, True, False),
    "msllm-full-bf16": ("dpo_msllm_worker.py", False, False, True), "trl-full-bf16": ("dpo_trl_worker.py", False, False, True),
    "msllm-lora-bf16": ("dpo_msllm_worker.py", True, False, True), "trl-lora-bf16": ("dpo_trl_worker.py", True, False, True)}
PAIRS = (("msllm-full", "trl-full"), ("msllm-lora", "trl-lora"), ("msllm-full-pre", "trl-full-pre"),
         ("msllm-full-bf16", "trl-full-bf16"), ("msllm-lora-bf16", "trl-lora-bf16"))


def msllm_overrides(hf_dir: str, data: str, seq: int, batch: int, steps: int, out: str, lora: bool = False,
                    precompute_ref: bool = False, bf16: bool = False) -> list[str]:
    """The command-line overrides of ``CONFIG`` for msllm's DPO run on the benchmark's pairs (the
    worker's and benchmarks/profile_dpo_step.py's): SmolLM2 from ``hf_dir``, batches in file order,
    beta 0.1, ``steps`` steps; LoRA r 8, alpha 16 on q/k/v/o without dropout when ``lora``."""
    pet = ["--pet_config.pet_type=lora", "--pet_config.lora_rank=8", "--pet_config.lora_alpha=16",
           "--pet_config.lora_dropout=0.0", "--pet_config.target_modules=.*wq|.*wk|.*wv|.*wo"] if lora else []
    return ["--run_mode=finetune", f"--load_checkpoint={hf_dir}", f"--train_dataset.dataset_dir={data}",
            f"--model.model_config.seq_length={seq}", f"--runner_config.batch_size={batch}",
            f"--runner_config.train_steps={steps}", "--train_dataset.shuffle=False", "--dpo.beta=0.1",
            f"--dpo.precompute_ref={bool(precompute_ref)}", f"--output_dir={out}",
            f"--model.model_config.compute_dtype={'bfloat16' if bf16 else 'float32'}", *pet]


def prepare(model_dir: str, tmp: str, pairs: int, seq: int) -> tuple[str, str]:
    """The benchmark's pairs as TRL records (``train.jsonl``) and msllm's MindRecord of them."""
    common.use_repo()
    from msllm.data.preference import preprocess_preference

    src = dpo_pairs.make(tmp, pairs, 1)["train"]["file"]
    out = os.path.join(tmp, "train.mindrecord")
    summary = preprocess_preference(src, model_dir, seq, out, shuffle=False)
    if summary["pairs_written"] != pairs:
        raise SystemExit(f"{summary['pairs_written']} of {pairs} pairs written ({summary['skipped']})")
    return src, out


def main() -> None:
    p = harness.arg_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--precompute", action="store_true", help="also the precomputed-reference variants")
    p.add_argument("--bf16", action="store_true", help="also the bf16-compute variants")
    p.add_argument("--only_bf16", action="store_true", help="the bf16-compute variants alone")
    p.add_argument("--only", default="", help="comma-separated variant names to run (overrides the flags above)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--note", default="")
    p.add_argument("--out", default=os.path.join(HERE, "results", "dpo_speed.json"))
    a = p.parse_args()
    model_dir = common.hf_dir("smollm2")
    names = [n for n in VARIANTS if (a.precompute or not n.endswith("-pre"))
             and ((a.bf16 or a.only_bf16) if n.endswith("-bf16") else not a.only_bf16)]
    if a.only:
        names = a.only.split(",")
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            raise SystemExit(f"--only: unknown variants {unknown}; expected some of {list(VARIANTS)}")
    t0 = time.time()
    runs: list = []
    with tempfile.TemporaryDirectory(prefix="dpo_speed_") as tmp:
        pairs_file, data = prepare(model_dir, tmp, a.batch * (a.steps + a.warmup), a.seq)
        for rnd in range(a.rounds):
            order = names if rnd % 2 == 0 else names[::-1]   # alternate which framework goes first
            for name in order:
                script, lora, pre, bf16 = VARIANTS[name]
                args = {"name": name, "hf_dir": model_dir, "config": os.path.join(common.ROOT, CONFIG), "data": data,
                        "pairs": pairs_file, "seq": a.seq, "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
                        "lora": lora, "precompute_ref": pre, "bf16": bf16}
                r = harness.run_worker(name, script, args, a.timeout, py=sys.executable)
                r["round"] = rnd
                harness.log_run(runs, r, f"round {rnd + 1} {name}", lambda r: (
                    f"{r['tokens_per_s']:.1f} tokens/s, {r['step_s_median']:.2f} s/step, peak RSS "
                    f"{r['peak_rss_mib']:.0f} MiB"))
    table = {}
    for name in names:
        ok, error = harness.ok_runs(runs, name)
        if not ok:
            table[name] = {"error": error}
            continue
        table[name] = {"runs": len(ok), "tokens_per_s": common.median([r["tokens_per_s"] for r in ok]),
                       "pairs_per_s": common.median([r["pairs_per_s"] for r in ok]),
                       "step_s": common.median([r["step_s_median"] for r in ok]),
                       "peak_rss_mib": max(r["peak_rss_mib"] for r in ok)}
    for m, t in PAIRS:
        if m in table and "error" not in table[m] and t in table and "error" not in table[t]:
            st = ratios.paired_stats(runs, m, t, "tokens_per_s")
            table[m]["speed_vs_trl"] = st
            # like for like: TRL's training_step plus its clipping and AdamW step (msllm's step has both)
            whole = ratios.paired_stats(runs, m, t, lambda r: r.get("tokens_per_s_with_update") or r.get("tokens_per_s"))
            if any(r.get("tokens_per_s_with_update") for r in runs if r.get("name") == t):
                table[m]["speed_vs_trl_with_update"] = whole
            table[m]["rss_vs_trl"] = table[m]["peak_rss_mib"] / table[t]["peak_rss_mib"]
    result = {"command": harness.command_line(), "note": a.note, "machine": common.machine(),
              "seq": a.seq, "batch": a.batch, "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
              "table": table, "runs": runs}
    lines = ["| variant | tokens/s | s/step | peak RSS MiB | msllm / TRL tokens/s (TRL: training_step) | "
             "msllm / TRL (TRL: + clipping and AdamW step) | RSS msllm / TRL |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += harness.md_rows(table, lambda n, r: (
        f"| {n} | {r['tokens_per_s']:.1f} | {r['step_s']:.2f} | {r['peak_rss_mib']:.0f} | "
        f"{ratios.fmt(r['speed_vs_trl']) if 'speed_vs_trl' in r else ''} | "
        f"{ratios.fmt(r['speed_vs_trl_with_update']) if 'speed_vs_trl_with_update' in r else ''} | "
        f"{r['rss_vs_trl']:.2f} |" if "rss_vs_trl" in r else
        f"| {n} | {r['tokens_per_s']:.1f} | {r['step_s']:.2f} | {r['peak_rss_mib']:.0f} | | | |"))
    harness.finish(a.out, result, "\n".join(lines), t0)


if __name__ == "__main__":
    main()
