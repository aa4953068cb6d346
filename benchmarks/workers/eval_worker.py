"""One timed evaluation run for benchmarks/eval_speed.py (a fresh process per run, so threads and
compiled graphs do not carry over between frameworks).

    python eval_worker.py {msllm|msllm-dense|harness} {mmlu|ppl} HF_DIR SEQ_LENGTH OUT.json [BATCH]

msllm: ``msllm.eval.runner.evaluate`` on the model loaded from the HF directory (GRAPH mode, CPU),
run twice (cold: including graph compilation; warm); ``msllm-dense``: the same with the output head at
every position (``dense_head``, the harness's work: the like-for-like row). harness: lm-eval's ``HFLM`` (torch, 2
threads, add_bos_token=True, the same SentencePiece tokenisation) on the same requests built by
msllm's task reader (the tests prove the prompts equal the harness's own); perplexity against a
direct transformers loop over the same windows.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "eval"))
sys.path.insert(0, os.path.join(ROOT, "tests"))   # tests/helpers.py, which evaltest_helpers imports

MMLU = os.path.join(ROOT, "examples", "data", "eval", "mmlu")
WIKI = os.path.join(ROOT, "examples", "data", "wiki_demo.txt")
PPL_CHARS = 60000


def ppl_file(out_dir):
    path = os.path.join(out_dir, "ppl_docs.txt")
    with open(WIKI, encoding="utf-8") as fh:
        text = fh.read(PPL_CHARS)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def run_msllm(task, hf_dir, seq, out, batch, dense=False):
    import mindspore as ms

    from msllm.config import RunConfig
    from msllm.data.tokenizer import LlamaTokenizer
    from msllm.eval.runner import evaluate
    from msllm.generation.loading import BUNDLED_TOKENIZER, load_for_inference

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = RunConfig()
    cfg.output_dir = os.path.dirname(out)
    net, mc, _ = load_for_inference(cfg, hf_dir)
    mc.seq_length = seq
    tok = LlamaTokenizer(BUNDLED_TOKENIZER)
    run_cfg = types.SimpleNamespace(output_dir=os.path.dirname(out), load_checkpoint=hf_dir)
    data = MMLU if task == "mmlu" else ppl_file(os.path.dirname(out))
    times, payload = [], None
    for _ in range(2):
        t = time.perf_counter()
        payload = evaluate(run_cfg, task, data, num_fewshot=5 if task == "mmlu" else None, batch_size=batch,
                           stride=seq, model=(net, mc, tok, 0, 1), dense_head=dense)
        times.append(time.perf_counter() - t)
    return times, payload["results"]


def run_harness(task, hf_dir, seq, out, batch):
    import torch

    torch.set_num_threads(2)
    from transformers import LlamaForCausalLM

    from evaltest_helpers import instances, sp_hf_tokenizer
    from lm_eval.models.huggingface import HFLM

    from msllm.data.tokenizer import LlamaTokenizer
    from msllm.eval.tasks import mmlu

    model = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    if task == "mmlu":
        lm = HFLM(pretrained=model, tokenizer=sp_hf_tokenizer(), add_bos_token=True, max_length=seq,
                  batch_size=batch, device="cpu")
        spec = mmlu.load(MMLU, 5, None)
        pairs = [(d.context, c) for d in spec.docs for c in d.continuations]
        times = []
        for _ in range(2):   # as msllm: a first (cold) and a second (warm) pass in one process
            t = time.perf_counter()
            res = lm.loglikelihood(instances(pairs), disable_tqdm=True)
            times.append(time.perf_counter() - t)
        correct, k = 0, 0
        for d in spec.docs:
            lls = [res[k + c][0] for c in range(4)]
            k += 4
            correct += int(max(range(4), key=lambda c: (lls[c], -c)) == d.gold)
        return times, {"acc": correct / len(spec.docs), "n": len(spec.docs)}
    tok = LlamaTokenizer(os.path.join(ROOT, "examples", "data", "tokenizer.model"))
    with open(ppl_file(os.path.dirname(out)), encoding="utf-8") as fh:
        ids = [tok.bos_id] + tok.encode(fh.read())
    times = []
    for _ in range(2):   # a cold and a warm pass, as msllm
        t = time.perf_counter()
        nll, n, window = 0.0, 0, seq + 1
        with torch.no_grad():
            for begin in range(0, len(ids) - 1, seq):  # disjoint windows, as msllm with stride = seq_length
                w = torch.tensor([ids[begin:begin + window]])
                logp = torch.log_softmax(model(w).logits[0, :-1], -1)
                nll -= float(logp.gather(-1, w[0, 1:, None]).sum())
                n += w.shape[1] - 1
        times.append(time.perf_counter() - t)
    return times, {"tokens": n, "mean_nll": nll / n}


def real_msllm(hf_dir, seq, out, batch, limit, config, passes, dense=False):
    """A real model as the user runs it: ``tools/evaluate.py --config CONFIG --load_checkpoint HF_DIR
    --task mmlu --num_fewshot 5 --limit N --model.model_config.seq_length=SEQ`` (the model's own
    tokenizer.json), the loaded model then scored ``passes`` times: cold (first, graphs compiled)
    and warm."""
    phases = {}
    t = time.perf_counter()
    from msllm.config import load_config
    from msllm.eval.runner import _load, _setup, evaluate

    phases["import_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cfg = load_config(os.path.join(ROOT, config), [f"--load_checkpoint={hf_dir}", "--run_mode=eval",
                                                   f"--model.model_config.seq_length={seq}",
                                                   f"--output_dir={os.path.dirname(out)}"])
    rank, world = _setup(cfg)
    net, mc, tok, _ = _load(cfg, None, None, rank)
    phases["load_s"] = time.perf_counter() - t
    times, payload = [], None
    for _ in range(passes):
        t = time.perf_counter()
        payload = evaluate(cfg, "mmlu", MMLU, 5, limit, batch, model=(net, mc, tok, rank, world), dense_head=dense)
        times.append(time.perf_counter() - t)
    r = payload["results"]
    return times, {"acc": r.get("acc"), "n": r.get("n", r.get("count")), "add_bos_token": payload["add_bos_token"],
                   "tokenizer": getattr(tok, "kind", None), **phases}


def real_harness(hf_dir, seq, out, batch, limit, passes):
    """lm-eval's HFLM on the HF directory itself (its tokenizer, ``add_bos_token`` default, fp32,
    torch 2 threads) over the same (context, continuation) requests as msllm's MMLU reader."""
    phases = {}
    t = time.perf_counter()
    import torch

    torch.set_num_threads(2)
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from msllm.eval.tasks import mmlu

    phases["import_s"] = time.perf_counter() - t
    t = time.perf_counter()
    lm = HFLM(pretrained=hf_dir, dtype="float32", max_length=seq, batch_size=batch, device="cpu")
    phases["load_s"] = time.perf_counter() - t
    spec = mmlu.load(MMLU, 5, limit)
    pairs = [(d.context, c) for d in spec.docs for c in d.continuations]
    times, correct = [], 0
    for _ in range(passes):
        t = time.perf_counter()
        reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
        res = lm.loglikelihood(reqs, disable_tqdm=True)
        times.append(time.perf_counter() - t)
        correct, k = 0, 0
        for d in spec.docs:
            lls = [res[k + c][0] for c in range(len(d.continuations))]
            k += len(d.continuations)
            correct += int(max(range(len(lls)), key=lambda c: (lls[c], -c)) == d.gold)
    return times, {"acc": correct / len(spec.docs), "n": len(spec.docs), "add_bos_token": lm.add_bos_token,
                   "threads": torch.get_num_threads(), **phases}


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("who", choices=["msllm", "msllm-dense", "harness"])
    ap.add_argument("task", choices=["mmlu", "ppl"])
    ap.add_argument("hf_dir")
    ap.add_argument("seq", type=int)
    ap.add_argument("out")
    ap.add_argument("batch", type=int, nargs="?", default=8)
    ap.add_argument("--real_config", help="a real model: its run YAML (msllm) / the HF directory itself (HFLM)")
    ap.add_argument("--limit", type=int, help="MMLU questions per subject")
    ap.add_argument("--passes", type=int, default=2)
    a = ap.parse_args()
    t0 = float(os.environ.get("BENCH_SPAWN_TIME", time.time()))
    extra = {}
    if a.real_config:
        if a.who != "harness":
            times, results = real_msllm(a.hf_dir, a.seq, a.out, a.batch, a.limit, a.real_config, a.passes,
                                        dense=a.who == "msllm-dense")
        else:
            times, results = real_harness(a.hf_dir, a.seq, a.out, a.batch, a.limit, a.passes)
        extra = {"spawn_to_first_pass_end_s": time.time() - t0 - sum(times[1:]), "limit": a.limit,
                 "seq_length": a.seq}
    else:
        if a.who == "harness":
            times, results = run_harness(a.task, a.hf_dir, a.seq, a.out, a.batch)
        else:
            times, results = run_msllm(a.task, a.hf_dir, a.seq, a.out, a.batch, dense=a.who == "msllm-dense")
        extra = {"spawn_to_first_pass_end_s": time.time() - t0 - sum(times[1:])}
    with open(a.out, "w") as fh:
        json.dump({"who": a.who, "task": a.task, "seconds": times, "results": results, "batch_size": a.batch,
                   **extra}, fh)


if __name__ == "__main__":
    main()
