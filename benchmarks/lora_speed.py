"""LoRA vs full fine-tuning in msllm, and vs transformers + PEFT (torch eager, 2 threads): tokens/s,
peak RSS and checkpoint size on the same LLaMA shape, initial weights and real batches (bundled
Alpaca records, msllm preprocessing, LLaMA tokenizer), fp32, AdamW, one process.

Variants: full fine-tuning; LoRA rank 8 and 64 on the attention projections (q/k/v/o, MindFormers'
``.*wq|.*wk|.*wv|.*wo``) and on every linear layer of the decoder (q/k/v/o, gate/up/down; not the
output head, like PEFT's ``all-linear``); alpha = 2 x rank, lora_dropout 0.05 (MindFormers'
``lora_llama2_7b.yaml`` recipe), and rank 8 on q/k/v/o without dropout (``-p0``: what the
dropout's saved activations cost). Each run is its own subprocess; runs alternate (msllm-full,
msllm-lora..., torch-full, peft-...) within a round so background load hits all alike.

    .venv/bin/python benchmarks/lora_speed.py --shape medium          # ~15 min on 2 idle cores
    .venv/bin/python benchmarks/lora_speed.py --shape tiny --variants msllm-full,msllm-lora-r8-attn

Every msllm variant also exists as ``<variant>-dense`` (e.g. ``msllm-full-dense``): the output head at
every position, like for like with transformers, where msllm's default (the compact loss) runs it only
at the positions that have a target.

Reports per variant: tokens/s (median step after warm-up), step s, first step s, peak RSS (VmHWM
before the checkpoint save), RSS after import / build / first step, trainable parameters,
AdamW state elements, checkpoint bytes; ratios LoRA / full (same framework) and msllm / PEFT (same
LoRA config), each the median of the per-round paired ratios with their min and max
(``benchmarks/ratios.py``), and the RSS saved against the optimizer states of the frozen weights
(2 x 4 bytes x frozen parameters: the target of issue #11). Writes
``benchmarks/results/lora_speed_<shape>.json`` and prints Markdown tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402
import ratios  # noqa: E402

ATTN_RE, ATTN = ".*wq|.*wk|.*wv|.*wo", ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]
ALL_RE = "|".join(ALL)  # matched against each module's last name component (msllm.config_lora)
DROPOUT = 0.05


def _pet(rank: int, which: str, msllm: bool, dropout: float = DROPOUT) -> dict:
    pet = {"lora_rank": rank, "lora_alpha": 2 * rank, "lora_dropout": dropout}
    if msllm:
        pet["target_modules"] = ATTN_RE if which == "attn" else ALL_RE
    else:
        pet["targets"] = ATTN if which == "attn" else ALL
    return pet


VARIANTS = {"msllm-full": ("lora_msllm_worker.py", None), "torch-full": ("lora_torch_worker.py", None)}
for _r in (8, 64):
    for _w in ("attn", "all"):
        VARIANTS[f"msllm-lora-r{_r}-{_w}"] = ("lora_msllm_worker.py", _pet(_r, _w, True))
        VARIANTS[f"peft-lora-r{_r}-{_w}"] = ("lora_torch_worker.py", _pet(_r, _w, False))
# without dropout: what the dropout's saved activations (its output and mask per module) cost
VARIANTS["msllm-lora-r8-attn-p0"] = ("lora_msllm_worker.py", _pet(8, "attn", True, 0.0))
VARIANTS["peft-lora-r8-attn-p0"] = ("lora_torch_worker.py", _pet(8, "attn", False, 0.0))
# like for like with transformers' loss: ``<msllm variant>-dense`` runs the output head at every position
# (msllm's default, the compact loss, runs it only at the positions that have a target)
DENSE = "-dense"
for _n in [n for n in VARIANTS if n.startswith("msllm-")]:
    VARIANTS[_n + DENSE] = VARIANTS[_n]
DEFAULT_ORDER = ["msllm-full", "msllm-lora-r8-attn", "peft-lora-r8-attn", "msllm-lora-r64-attn",
                 "peft-lora-r64-attn", "msllm-lora-r8-all", "peft-lora-r8-all", "msllm-lora-r64-all",
                 "peft-lora-r64-all", "torch-full", "msllm-lora-r8-attn-p0", "peft-lora-r8-attn-p0"]
DEFAULT_STEPS = {"tiny": (6, 2), "medium": (4, 2), "smollm2": (5, 2)}  # measured steps, warm-up steps
# a real model (issue #19): full fine-tuning and LoRA r8 q/k/v/o alpha 16 without dropout, alternating
REAL_ORDER = ["msllm-full", "torch-full", "msllm-lora-r8-attn-p0", "peft-lora-r8-attn-p0"]
# the real model's run YAML (msllm side; load_checkpoint = the HF directory); its runner_wrapper clips
# gradients at norm 1.0, so the transformers side does too (HF Trainer's default max_grad_norm)
REAL_CONFIG = {"smollm2": ("configs/smollm2/run_smollm2_135m.yaml", 1.0)}


def versions() -> dict:
    """Versions of the frameworks compared (asked of the benchmark's interpreter)."""
    code = ("import json, mindspore, torch, transformers, peft, tokenizers; print(json.dumps({m.__name__: "
            "m.__version__ for m in (mindspore, torch, transformers, peft, tokenizers)}))")
    p = subprocess.run([common.MAIN_PY, "-c", code], capture_output=True, text=True, env=dict(os.environ, GLOG_v="3"))
    return json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-500:]}


def run_worker(name: str, shape: str, steps: int, warmup: int, timeout: float, kernel_stats: bool = False) -> dict:
    script, pet = VARIANTS[name]
    args = {"shape": shape, "steps": steps, "warmup": warmup, "pet": pet, "name": name,
            "kernel_stats": kernel_stats and script == "lora_msllm_worker.py"}
    if name.endswith(DENSE):
        args["compact_loss"] = False
    if shape in common.REAL_SHAPES:
        args.update(hf_dir=common.hf_dir(shape), config=REAL_CONFIG[shape][0], clip_grad_norm=REAL_CONFIG[shape][1])
    return harness.run_worker(name, script, args, timeout)


def summarise(shape: str, runs: list[dict]) -> dict:
    table = {}
    for name in dict.fromkeys(r["framework"] for r in runs):
        ok, error = harness.ok_runs(runs, name)
        if not ok:
            table[name] = {"error": error}
            continue
        r0 = ok[0]
        tps = [r["tokens_per_s"] for r in ok]
        row = {"runs": len(ok), "tokens_per_s": common.median(tps), "tokens_per_s_min": min(tps),
               "tokens_per_s_max": max(tps), "tokens_per_s_rounds": tps,
               "loads_after": [r.get("load_after") for r in ok],
               "step_s": common.median([r["step_s_median"] for r in ok]),
               "first_step_s": common.median([r["first_step_s"] for r in ok]),
               "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
               "rss_mib": r0["rss_mib"], "checkpoint_bytes": r0["checkpoint_bytes"],
               "base_params": r0["base_params"], "trainable_params": r0["trainable_params"],
               "optimizer_state_elements": r0["optimizer_state_elements"], "loads": [r["load_before"] for r in ok]}
        frozen = r0["base_params"] if r0.get("pet") else 0
        row["frozen_optimizer_state_mib"] = 8 * frozen / 2 ** 20
        table[name] = row
    # ratios: the median of the per-round paired ratios (same round), with their min and max
    def pair(row, num, den, key):
        st = ratios.paired_stats(runs, num, den, "tokens_per_s")
        if st["n"]:
            row[key], row[key + "_min"], row[key + "_max"], row[key + "_rounds"] = (
                st["median"], st["min"], st["max"], st["rounds"])

    for name, row in table.items():
        if "error" in row:
            continue
        dense = DENSE if name.endswith(DENSE) else ""
        if name.startswith("msllm-full"):
            pair(row, name, "torch-full", "speed_vs_torch")
        if "-lora-" not in name:
            continue
        fw, cfg = name[:len(name) - len(dense)].split("-lora-", 1)
        full_name = "msllm-full" + dense if fw == "msllm" else "torch-full"
        full = table.get(full_name, {})
        if "error" not in full and full:
            pair(row, name, full_name, "speed_vs_full")
            row["rss_saved_mib"] = full["peak_rss_mib"] - row["peak_rss_mib"]
            row["rss_saved_vs_frozen_states"] = row["rss_saved_mib"] / row["frozen_optimizer_state_mib"]
        if fw == "msllm":
            other = table.get(f"peft-lora-{cfg}", {})
            if other and "error" not in other:
                pair(row, name, f"peft-lora-{cfg}", "speed_vs_peft")
                row["rss_vs_peft"] = row["peak_rss_mib"] / other["peak_rss_mib"]
    return {"shape": shape, "shape_params": common.shape(shape), "frameworks": table}


def _ratio(row: dict, key: str) -> str:
    """A paired ratio as 'median (min-max)', or '' when the row has none."""
    if key not in row:
        return ""
    n = len(row[key + "_rounds"])
    return ratios.fmt({"median": row[key], "min": row[key + "_min"], "max": row[key + "_max"], "n": n})


def markdown(summary: dict) -> str:
    lines = ["| variant | tokens/s median (min-max) | x full | x transformers(+PEFT) | step s | first step s | peak RSS MiB | RSS saved vs full MiB "
             "(frozen AdamW states MiB) | trainable params | checkpoint MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def row(name, r):
        saved = (f"{r['rss_saved_mib']:.0f} ({r['frozen_optimizer_state_mib']:.0f})" if "rss_saved_mib" in r else "")
        vs = "speed_vs_peft" if "speed_vs_peft" in r else "speed_vs_torch"
        return (f"| {name} | {r['tokens_per_s']:.0f} ({r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}) "
                f"| {_ratio(r, 'speed_vs_full')} | {_ratio(r, vs)} | {r['step_s']:.2f} | {r['first_step_s']:.1f} "
                f"| {r['peak_rss_mib']:.0f} | {saved} | {r['trainable_params'] / 1e6:.3f}M "
                f"| {r['checkpoint_bytes'] / 1e6:.1f} |")

    lines += harness.md_rows(summary["frameworks"], row)
    lines += ["", "| variant | RSS after import | after build | after first step | peak (MiB) |", "|---|---|---|---|---|"]
    for name, r in summary["frameworks"].items():
        if "error" not in r:
            m = r["rss_mib"]
            lines.append(f"| {name} | {m.get('after_import', 0):.0f} | {m.get('after_build', 0):.0f} "
                         f"| {m.get('after_first_step', 0):.0f} | {r['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--shape", default="medium", choices=sorted(common.SHAPES) + sorted(common.REAL_SHAPES),
                   help="a random LLaMA shape, or a real model (smollm2: SmolLM2-135M-Instruct's HF directory "
                        "on both sides, Alpaca tokenized with its tokenizer and chat template)")
    p.add_argument("--variants", default=None, help=f"default: {','.join(DEFAULT_ORDER)}; for a real model "
                                                    f"{','.join(REAL_ORDER)}")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--out", default=None)
    p.add_argument("--kernel_stats", action="store_true", help="msllm variants: also ms per step in each msllm "
                   "kernel (a profile: the timing slows the step)")
    a = p.parse_args(argv)
    steps, warmup = DEFAULT_STEPS[a.shape]
    steps, warmup = a.steps or steps, a.warmup if a.warmup is not None else warmup
    real = a.shape in common.REAL_SHAPES
    names = [n.strip() for n in (a.variants or ",".join(REAL_ORDER if real else DEFAULT_ORDER)).split(",")
             if n.strip()]
    for n in names:
        if n not in VARIANTS:
            p.error(f"unknown variant {n!r}; expected some of {', '.join(VARIANTS)}")
    info = common.machine()
    s = common.shape(a.shape)
    print(f"# {info}\n# shape {a.shape}: {s}; {steps} measured steps after {warmup} warm-up; {a.rounds} round(s); "
          f"load {common.loadavg()}", flush=True)
    if real:
        data = common.prepare_hf_data(s["data_tag"], common.hf_dir(a.shape), s["seq_length"])
        with open(data + ".commands.json") as fh:
            data_commands = json.load(fh)
    else:
        common.prepare_data(s["seq_length"])
        common.prepare_weights(a.shape)
        data_commands = None
    t0, runs, load0 = time.time(), [], common.loadavg()
    for rnd in range(a.rounds):
        for n in names:
            r = run_worker(n, a.shape, steps, warmup, a.timeout, a.kernel_stats)
            if r.get("kernel_ms_per_step"):
                ks = r["kernel_ms_per_step"]
                print(f"  {n}: {sum(ks.values()):.0f} ms of {1e3 * r['step_s_median']:.0f} ms per step in msllm kernels: "
                      + ", ".join(f"{k} {v:.0f}" for k, v in sorted(ks.items(), key=lambda kv: -kv[1])), flush=True)
            r["round"] = rnd
            harness.log_run(runs, r, f"round {rnd} {n:20s}", lambda r: (
                f"{r['tokens_per_s']:7.0f} tok/s  step {r['step_s_median']:.2f} s  first "
                f"{r['first_step_s']:.1f} s  peak RSS {r['peak_rss_mib']:.0f} MiB  ckpt "
                f"{r['checkpoint_bytes'] / 1e6:.1f} MB  load {r['load_before']} -> {r['load_after']}"))
    summary = summarise(a.shape, runs)
    summary.update(machine=info, command=harness.command_line(), steps=steps, warmup=warmup, rounds=a.rounds,
                   total_seconds=time.time() - t0, runs=runs, data_commands=data_commands,
                   hf_dir=common.hf_dir(a.shape), load_at_start=load0, load_at_end=common.loadavg(),
                   versions=versions())
    harness.finish(a.out or os.path.join(HERE, "results", f"lora_speed_{a.shape}.json"), summary, markdown(summary),
                  t0)

if __name__ == "__main__":
    main()
