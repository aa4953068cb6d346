"""Packed vs unpacked SFT: supervised tokens per second on SmolLM2-135M-Instruct at seq_length 2048,
full fine-tuning and LoRA (rank 8 on q/k/v/o), msllm against transformers' packing path.

Data: the bundled real Alpaca records rendered with SmolLM2's chat template and its tokenizer
(msllm's preprocessing, ``--template chat_template``), the same conversations in the same order for
every variant:

* ``msllm-unpacked``: one conversation per row padded to 2048 + 1 (what ``llama_preprocess.py``
  writes without ``--pack``), batch 1;
* ``msllm-packed``: ``--pack`` rows (whole conversations greedily, ``actual_seq_len``), batch 1, on
  msllm's per-document flash kernel;
* ``torch-flatten``: transformers + torch eager (2 threads), the conversations of each msllm packed
  row given to ``DataCollatorWithFlattening`` (one row without padding, ``position_ids`` restarting
  per conversation; transformers' SDPA attention then keeps them apart: torchtune-style packing);
  LoRA by PEFT with the same rank, alpha and targets.

"Supervised tokens" are the positions with a target (the assistant turns), the same count for
every variant over the same conversations; tokens/s = supervised tokens of the timed steps /
their seconds (steps after ``--warmup``; msllm in GRAPH_MODE, first step = compile excluded).
The timed steps are the conversations of ``--steps`` packed rows (after ``--warmup`` rows): the
unpacked variant takes one step per conversation, so every variant trains on the same supervised
tokens. fp32, AdamW (lr 1e-5), one process each. The ``-bf16`` variants compute the matmuls in
bfloat16 on both sides, float32 parameters and optimizer: msllm with ``compute_dtype: bfloat16``
(its CPU kernels round the GEMMs' inputs to bfloat16, float32 sums, everything else float32),
transformers under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (PyTorch's CPU mixed precision:
linear layers and SDPA in bfloat16, their outputs bfloat16). Variants run in alternating order per round
(``--rounds``); the ratio packed / unpacked and msllm-packed / torch-flatten are per-round paired.

    .venv/bin/python benchmarks/pack_speed.py --rounds 3 --steps 6        # the figure for BENCHMARKS.md
    .venv/bin/python benchmarks/pack_speed.py --rounds 1 --steps 2 --warmup 1   # a quick check

Writes ``benchmarks/results/pack_speed.json`` (with the machine, its load, and each run's steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SEQ = 2048   # --seq_length (the figure is at 2048; a smaller one only for a quick check)
LORA = {"rank": 8, "alpha": 16, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def conversations(model_dir: str, limit: int):
    """(input_ids, labels) of the bundled Alpaca conversations (SmolLM2 chat template), in file order."""
    sys.path.insert(0, REPO)
    from msllm.data.conversation import alpaca_to_conversation, validate_conversation_records
    from msllm.data.samples import build_qa_samples
    from msllm.data.templates import resolve_template
    from msllm.data.tokenizer import load_tokenizer

    with open(os.path.join(REPO, "examples", "data", "alpaca_en_demo.json"), encoding="utf-8") as fh:
        records = json.load(fh)[:limit]
    conv = validate_conversation_records(alpaca_to_conversation(records, "alpaca"), "alpaca")
    tok = load_tokenizer(model_dir)
    res = build_qa_samples(tok, conv, SEQ, resolve_template("chat_template", tok))
    return [(r.input_ids, r.labels) for r in res if r.skip_reason is None]


def batches(model_dir: str, warmup: int, steps: int, packed: bool):
    """(warm-up batches, timed batches), 1 row each, over the same conversations for every variant:
    the timed ones are the conversations of packed rows ``warmup .. warmup + steps - 1`` (as those
    rows, or one padded row per conversation: then more steps, the same supervised tokens).
    Each batch: ids (1, T+1), labels (1, T+1), ends (1, N) or None, docs (its samples)."""
    sys.path.insert(0, REPO)   # this checkout's msllm (the torch worker imports nothing else of it)
    from msllm.data.packing import pack_samples, pad_actual_seq_len
    from msllm.data.samples import pad_sample

    samples = conversations(model_dir, 999)
    rows = pack_samples(samples, SEQ, 0)[:warmup + steps]
    width = max(len(r[2]) for r in rows) + 1
    out, k = [], 0
    for r in rows:
        docs = samples[k:k + len(r[2])]
        k += len(r[2])
        if packed:
            out.append([{"ids": r[0][None], "labels": r[1][None],
                         "ends": pad_actual_seq_len(r[2], width, SEQ)[None], "docs": docs}])
        else:
            row = []
            for d in docs:
                ids, lab = pad_sample(d[0], d[1], SEQ, 0)
                row.append({"ids": ids[None], "labels": lab[None], "ends": None, "docs": [d]})
            out.append(row)
    warm = [b for row in out[:warmup] for b in row][:max(warmup, 1) if not packed else None]
    return warm, [b for row in out[warmup:] for b in row]


def supervised(b) -> int:
    return int(sum(int((d[1][1:] != -100).sum()) for d in b["docs"]))


def msllm_worker(a) -> dict:
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor, nn

    sys.path.insert(0, REPO)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    from msllm.config import load_config
    from msllm.generation.loading import load_for_inference
    from msllm.training.step import TrainStep

    cfg = load_config(os.path.join(REPO, "configs", "smollm2", "run_smollm2_135m.yaml"),
                      [f"--load_checkpoint={a.model_dir}", f"--model.model_config.seq_length={SEQ}",
                       f"--model.model_config.compute_dtype={'bfloat16' if a.bf16 else 'float32'}"])
    net, mc, _ = load_for_inference(cfg, fast_paths=True)
    net.set_train(True)
    if a.lora:
        from msllm.lora.apply import apply_lora
        from msllm.config_lora import PetConfig

        apply_lora(net, PetConfig(lora_rank=LORA["rank"], lora_alpha=LORA["alpha"],
                                  target_modules="|".join(LORA["targets"])))
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-5)
    step = TrainStep(net, opt, loss_scale="none", max_grad_norm=1.0)
    warm, timed = batches(a.model_dir, a.warmup, a.steps, a.packed)
    times, sup, losses = [], 0, []
    for i, b in enumerate(warm + timed):
        args = [Tensor(b["ids"]), Tensor(b["labels"])] + ([Tensor(b["ends"])] if b["ends"] is not None else [])
        t0 = time.perf_counter()
        loss = float(step(*args)[0].asnumpy())
        dt = time.perf_counter() - t0
        losses.append(loss)
        if i >= len(warm):
            times.append(dt)
            sup += supervised(b)
    return {"supervised_tokens": sup, "seconds": sum(times), "step_s": times, "last_loss": loss,
            "losses": losses, "tokens_per_s": sup / sum(times)}


def torch_worker(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"],
                                                 target_modules=LORA["targets"], lora_dropout=0.0))
    model.train()
    # MindSpore's nn.AdamWeightDecay defaults, which the msllm worker uses (eps 1e-6, no weight decay)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, eps=1e-6, weight_decay=0.0)
    collate = DataCollatorWithFlattening(return_position_ids=True)
    warm, timed = batches(a.model_dir, a.warmup, a.steps, True)
    times, sup, losses = [], 0, []
    for i, b in enumerate(warm + timed):
        # transformers shifts labels inside the model; msllm's labels are already per input position
        feats = [{"input_ids": d[0].tolist(), "labels": d[1].tolist()} for d in b["docs"]]
        batch = collate(feats)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            # use_cache=False: transformers keeps the documents apart (block-diagonal causal mask from
            # the restarting position_ids) only when no cache is passed (masking_utils: "only if the 2D
            # attention mask is explicitly None, and we don't have cache"); with the model's default
            # use_cache=True a DynamicCache is made even in training and every document attends to the
            # ones before it, while its rotary positions restart (the loss is then ~2.5x the true one)
            out = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                        use_cache=False)
        losses.append(float(out.loss))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if i >= len(warm):
            times.append(dt)
            sup += supervised(b)
    return {"supervised_tokens": sup, "seconds": sum(times), "step_s": times, "last_loss": losses[-1],
            "losses": losses, "tokens_per_s": sup / sum(times)}


VARIANTS = {  # name: (worker, packed, lora, bf16 compute)
    "msllm-unpacked-full": ("msllm", False, False, False), "msllm-packed-full": ("msllm", True, False, False),
    "torch-flatten-full": ("torch", True, False, False),
    "msllm-unpacked-lora": ("msllm", False, True, False), "msllm-packed-lora": ("msllm", True, True, False),
    "torch-flatten-lora": ("torch", True, True, False),
    "msllm-packed-full-bf16": ("msllm", True, False, True), "torch-flatten-full-bf16": ("torch", True, False, True),
    "msllm-packed-lora-bf16": ("msllm", True, True, True), "torch-flatten-lora-bf16": ("torch", True, True, True),
}


def main():
    global SEQ
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seq_length", type=int, default=SEQ)
    p.add_argument("--out", default=os.path.join(HERE, "results", "pack_speed.json"))
    p.add_argument("--note", default="", help="recorded with the results (e.g. 'shared machine')")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    SEQ = a.seq_length
    if a.worker:
        result = (msllm_worker if a.worker == "msllm" else torch_worker)(a)
        print("BENCH_RESULT " + json.dumps(result), flush=True)
        return
    sys.path.insert(0, REPO)
    from msllm.convert.real_model import ensure_smollm2

    model_dir = ensure_smollm2()
    names = a.variants.split(",")
    runs = []
    for rnd in range(a.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            kind, packed, lora, bf16 = VARIANTS[name]
            # every variant sees the same conversations: the packed rows' first `steps + warmup` rows
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--model_dir", model_dir,
                   "--steps", str(a.steps), "--warmup", str(a.warmup), "--rows", str(a.steps + a.warmup),
                   "--seq_length", str(SEQ)]
            cmd += ["--packed"] if packed else []
            cmd += ["--lora"] if lora else []
            cmd += ["--bf16"] if bf16 else []
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            line = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
            if not line:
                print(proc.stderr[-3000:])
                raise SystemExit(f"{name}: no result (rc {proc.returncode})")
            r = dict(json.loads(line[-1][len("BENCH_RESULT "):]), variant=name, round=rnd,
                     wall_s=time.time() - t0, loadavg=open("/proc/loadavg").read().split()[:3])
            print(f"round {rnd + 1} {name:<22} {r['tokens_per_s']:8.1f} supervised tokens/s "
                  f"({r['supervised_tokens']} in {r['seconds']:.1f} s)", flush=True)
            runs.append(r)
    summary = {}
    for lora in ("full", "lora", "full-bf16", "lora-bf16"):
        per = {}
        for rnd in range(a.rounds):
            tps = {r["variant"]: r["tokens_per_s"] for r in runs if r["round"] == rnd}
            un, pk, tf = (tps.get(f"{k}-{lora}") for k in ("msllm-unpacked", "msllm-packed", "torch-flatten"))
            if pk and un:
                per.setdefault("packed_over_unpacked", []).append(pk / un)
            if pk and tf:
                per.setdefault("packed_over_torch_flatten", []).append(pk / tf)
            base = tps.get(f"msllm-packed-{lora[:4]}")
            if lora.endswith("bf16") and pk and base:
                per.setdefault("bf16_over_float32", []).append(pk / base)
        if per:
            summary[lora] = {k: {"median": sorted(v)[len(v) // 2], "min": min(v), "max": max(v)}
                             for k, v in per.items()}
    # the same weights and rows: the first step's loss (before any update) is the same model's loss on
    # the same documents on both sides; a mismatch means one side attends across documents
    for lora in ("full", "lora", "full-bf16", "lora-bf16"):
        pk = [r for r in runs if r["variant"] == f"msllm-packed-{lora}"]
        tf = [r for r in runs if r["variant"] == f"torch-flatten-{lora}"]
        if pk and tf:
            summary.setdefault("first_step_loss", {})[lora] = {"msllm": pk[0]["losses"][0],
                                                               "torch": tf[0]["losses"][0]}
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump({"note": a.note, "seq_length": SEQ, "cpu": _cpu(), "nproc": os.cpu_count(), "runs": runs,
                   "summary": summary, "args": vars(a)}, fh, indent=1)
    print("written", a.out)


def _cpu() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        return next((x.split(":", 1)[1].strip() for x in fh if x.startswith("model name")), "?")


if __name__ == "__main__":
    main()
