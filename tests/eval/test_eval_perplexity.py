"""Perplexity equals a direct transformers computation on the same tokens (1e-5 relative): text
files with the sliding window of the HF perplexity guide, the evaluation MindRecord of
``run_mode: eval`` (through run_msllm.py), and ``evaluate_loss`` for evaluation during training."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types

import numpy as np
import torch

from evaltest_helpers import DATA, HF_CONFIG, REPO
from msllm.eval.perplexity import evaluate_loss, record_rows, summarise, text_rows
from msllm.eval.runner import evaluate
from msllm.eval.scoring import query_bucket, score_rows, scorer_for


def guide_nll(model, ids, max_length, stride):
    """The HF perplexity guide's loop (transformers/docs/source/en/perplexity.md), summing the
    log-probabilities of the scored tokens in float64: (nll sum, tokens)."""
    seq_len, prev_end, nll, n = len(ids), 0, 0.0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        window = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            logp = torch.log_softmax(model(window).logits[0, :-1].double(), -1)   # predicts window[1:]
        targets = window[0, 1:]
        picked = logp[torch.arange(len(targets)), targets]
        k = min(trg_len, len(targets))
        nll -= float(picked[-k:].sum())
        n += k
        prev_end = end
        if end == seq_len:
            break
    return nll, n


def wiki_docs(count, chars=2500):
    """The first ``count`` articles of the bundled Wikipedia text, cut to ``chars`` characters."""
    with open(os.path.join(DATA, "wiki_demo.txt"), encoding="utf-8") as fh:
        return [next(fh).strip()[:chars] for _ in range(count)]


def test_sliding_window_perplexity_matches_transformers(models, tokenizer):
    hf, net, _, _, _ = models
    docs = [[tokenizer.bos_id] + tokenizer.encode(t)[:300] for t in wiki_docs(2)]
    for max_length, stride in ((64, 24), (64, 64)):  # overlapping windows, then disjoint ones
        rows, owner = text_rows(docs, max_length, stride)
        scores = score_rows(scorer_for(net, 4, 0, 0), rows)
        for d, ids in enumerate(docs):
            ours = summarise(scores, [k for k, o in enumerate(owner) if o == d])
            ref_nll, ref_n = guide_nll(hf, ids, max_length + 1, stride)
            assert ours["tokens"] == ref_n == len(ids) - 1       # every token after BOS once
            assert abs(ours["nll_sum"] - ref_nll) / ref_nll < 1e-5, (ours, ref_nll)


def test_ppl_task_on_a_jsonl_file(models, tokenizer, tmp_path, capsys):
    hf, net, cfg, _, ckpt = models
    path = tmp_path / "docs.jsonl"
    texts = wiki_docs(3)
    path.write_text("".join(f'{{"text": {__import__("json").dumps(t)}}}\n' for t in texts), encoding="utf-8")
    run_cfg = types.SimpleNamespace(output_dir=str(tmp_path), load_checkpoint=ckpt)
    payload = evaluate(run_cfg, "ppl", str(path), batch_size=2, stride=400, model=(net, cfg, tokenizer, 0, 1))
    nll = n = 0
    for t in texts:
        a, b = guide_nll(hf, [tokenizer.bos_id] + tokenizer.encode(t), cfg.seq_length + 1, 400)
        nll, n = nll + a, n + b
    r = payload["results"]
    assert r["tokens"] == n and abs(r["nll_sum"] - nll) / nll < 1e-5
    assert math.isclose(r["ppl"], math.exp(nll / n), rel_tol=1e-5)
    assert "ppl: tokens" in capsys.readouterr().out


def mindrecord_reference(hf, ids, labels):
    """Token-weighted mean NLL of labels[1:] (not -100) given input_ids[:-1], with transformers."""
    nll, n = 0.0, 0
    for i in range(0, len(ids), 64):
        x = torch.tensor(ids[i:i + 64, :-1].astype(np.int64))
        y = torch.tensor(labels[i:i + 64, 1:].astype(np.int64))
        with torch.no_grad():
            logp = torch.log_softmax(hf(x).logits.double(), -1)
        keep = y != -100
        nll -= float(logp.gather(-1, y.clamp(min=0)[..., None])[..., 0][keep].sum())
        n += int(keep.sum())
    return nll / n, n


def test_run_mode_eval_perplexity_on_a_mindrecord(models, alpaca_mindrecord, tmp_path):
    """``run_msllm.py --run_mode eval --eval_dataset_dir X`` on a converted checkpoint, over 100
    real tokenized Alpaca samples (seq_length 64; 100 is not a multiple of the batch size 16)."""
    from msllm.data.mindrecord import read_mindrecord_arrays, write_mindrecord

    hf, net, cfg, _, ckpt = models
    full = read_mindrecord_arrays(alpaca_mindrecord)
    arrays = {k: v[:100] for k, v in full.items()}
    eval_path = str(tmp_path / "eval.mindrecord")
    write_mindrecord(eval_path, zip(arrays["input_ids"], arrays["labels"]))
    ref_nll, ref_n = mindrecord_reference(hf, arrays["input_ids"], arrays["labels"])
    shape = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "n_kv_heads": 2, "intermediate_size": 96,
             "seq_length": 64, "vocab_size": 32000}
    cmd = [sys.executable, os.path.join(REPO, "run_msllm.py"), "--config",
           os.path.join(REPO, "configs", "llama", "run_llama_tiny.yaml"), "--run_mode", "eval",
           "--load_checkpoint", ckpt, "--eval_dataset_dir", eval_path, "--output_dir", str(tmp_path),
           "--eval_dataset.batch_size=16"] + [f"--model.model_config.{k}={v}" for k, v in shape.items()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval_loss:")][0]
    print(line)
    tokens = int(line.split("tokens ")[1].split(",")[0])
    loss = float(line.split("loss (mean nll) ")[1].split(",")[0])
    ppl = float(line.split("perplexity ")[1].split(",")[0])
    assert tokens == ref_n
    assert abs(loss - ref_nll) / ref_nll < 1e-5
    assert abs(ppl - math.exp(ref_nll)) / math.exp(ref_nll) < 1e-4
    results = [f for f in os.listdir(tmp_path / "eval") if f.startswith("results_eval_loss_")]
    assert len(results) == 1


def test_evaluate_loss_for_the_training_loop(models, alpaca_mindrecord):
    from msllm.data.mindrecord import read_mindrecord_arrays

    hf, net, cfg, _, _ = models
    arrays = read_mindrecord_arrays(alpaca_mindrecord)
    ids, labels = arrays["input_ids"][:40], arrays["labels"][:40]
    mean_nll, ppl, tokens = evaluate_loss(net, (ids, labels), batch_size=8)
    ref_nll, ref_n = mindrecord_reference(hf, ids, labels)
    assert tokens == ref_n and abs(mean_nll - ref_nll) / ref_nll < 1e-5
    assert math.isclose(ppl, math.exp(mean_nll), rel_tol=1e-12)
    rows = record_rows(ids, labels, -100)
    assert len(rows) <= 40
    # each batch has its own number of label tokens (5 batches, 5 counts here); the graphs compiled are one per
    # rounded count (query_bucket), not one per batch: a training run's first evaluation compiled 37 graphs in 62 s
    scorer = scorer_for(net, 8, 0, 0, set_eval=False)
    counts = [sum(len(pos) for i in item.rows for _, pos, _ in rows[i].queries) for item in scorer.plan(rows)]
    buckets = {query_bucket(n, scorer.max_batch_tokens) for n in counts}
    print("label tokens per batch", counts, "-> graph shapes", sorted(buckets))
    assert len(set(counts)) > len(buckets) and len(scorer.plain.compile_cache) == len(buckets)
    assert HF_CONFIG["hidden_size"] == net.config.hidden_size
