"""One timed evaluation run for benchmarks/eval_speed.py (a fresh process per run, so threads and
compiled graphs do not carry over between frameworks).

    python eval_worker.py {msllm|harness} {mmlu|ppl} HF_DIR SEQ_LENGTH OUT.json [BATCH]

msllm: ``msllm.eval.runner.evaluate`` on the model loaded from the HF directory (GRAPH mode, CPU),
run twice (cold: including graph compilation; warm). harness: lm-eval's ``HFLM`` (torch, 2
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


def run_msllm(task, hf_dir, seq, out, batch):
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
                           stride=seq, model=(net, mc, tok, 0, 1))
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
        t = time.perf_counter()
        res = lm.loglikelihood(instances(pairs), disable_tqdm=True)
        dt = time.perf_counter() - t
        correct, k = 0, 0
        for d in spec.docs:
            lls = [res[k + c][0] for c in range(4)]
            k += 4
            correct += int(max(range(4), key=lambda c: (lls[c], -c)) == d.gold)
        return [dt], {"acc": correct / len(spec.docs), "n": len(spec.docs)}
    tok = LlamaTokenizer(os.path.join(ROOT, "examples", "data", "tokenizer.model"))
    with open(ppl_file(os.path.dirname(out)), encoding="utf-8") as fh:
        ids = [tok.bos_id] + tok.encode(fh.read())
    t = time.perf_counter()
    nll, n, window = 0.0, 0, seq + 1
    with torch.no_grad():
        for begin in range(0, len(ids) - 1, seq):  # disjoint windows, as msllm with stride = seq_length
            w = torch.tensor([ids[begin:begin + window]])
            logp = torch.log_softmax(model(w).logits[0, :-1], -1)
            nll -= float(logp.gather(-1, w[0, 1:, None]).sum())
            n += w.shape[1] - 1
    dt = time.perf_counter() - t
    return [dt], {"tokens": n, "mean_nll": nll / n}


def main():
    who, task, hf_dir, seq, out = sys.argv[1:6]
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else 8
    fn = run_msllm if who == "msllm" else run_harness
    times, results = fn(task, hf_dir, int(seq), out, batch)
    with open(out, "w") as fh:
        json.dump({"who": who, "task": task, "seconds": times, "results": results, "batch_size": batch}, fh)


if __name__ == "__main__":
    main()
