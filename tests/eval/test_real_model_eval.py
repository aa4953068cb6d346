"""Evaluation of a real pretrained model: SmolLM2-135M-Instruct (the ``smollm2_dir`` fixture, a
Hugging Face directory loaded by ``run_eval`` itself) equals lm-evaluation-harness / transformers.

* task ``ppl`` on real Wikipedia text (examples/data/wiki_demo.txt): per document, the NLL sum
  equals a transformers computation over the same sliding windows (the HF perplexity guide's loop,
  which msllm's ppl task follows) within 1e-4 relative, and, for documents whose windows are the
  ones lm-eval's ``HFLM.loglikelihood_rolling`` makes (disjoint windows, every window full:
  ``--stride`` = seq_length and a length of whole windows, or a single window), equals lm-eval's
  rolling log-likelihood within 1e-4 relative;
* task ``mmlu`` 5-shot (the bundled MMLU sample, 2 subjects x 3 questions): every request's
  log-likelihood equals lm-eval ``HFLM``'s on the same directory within 1e-4 (and ``is_greedy``,
  the token ids of every request and the predictions agree).

Reference: ``HFLM(pretrained=AutoModelForCausalLM.from_pretrained(dir, dtype=float32),
tokenizer=AutoTokenizer.from_pretrained(dir), max_length=...)`` (ppl: msllm's window; mmlu: unset
on both sides, so each takes the directory's positions) with
``add_bos_token`` left at its default (None: the tokenizer's own rule, no BOS for SmolLM2).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from evaltest_helpers import DATA, EVAL_DATA, REPO, instances

pytestmark = [pytest.mark.slow,   # minutes on 2 CPU cores; still run in CI
              pytest.mark.usefixtures("one_torch_thread")]

CONFIG = os.path.join(REPO, "configs", "smollm2", "run_smollm2_135m.yaml")
TOL = 1e-4
PPL_LENGTH = 256     # ppl: windows of 256 tokens (the first 3000 characters make three)
SUBJECTS = ("astronomy", "high_school_geography")


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    """(transformers model in float32, AutoTokenizer) of the SmolLM2 directory (the session's)."""
    return smollm2_hf


def hflm(hf, max_length: int):
    """lm-eval's HFLM on the transformers model, ``add_bos_token`` at its default (None)."""
    from lm_eval.models.huggingface import HFLM

    model, tok = hf
    return HFLM(pretrained=model, tokenizer=tok, max_length=max_length, batch_size=4, device="cpu")


def run_config(smollm2_dir, seq_length: int, out):
    from msllm.config import load_config

    return load_config(CONFIG, [f"--model.model_config.seq_length={seq_length}", f"--load_checkpoint={smollm2_dir}",
                                f"--output_dir={out}", "--seed=0"])


def guide_nll(model, ids, max_length, stride):
    """The HF perplexity guide's loop (transformers docs, perplexity.md) over token ``ids``, the
    log-probabilities of the scored tokens summed in float64: (nll sum, tokens scored)."""
    seq_len, prev_end, nll, n = len(ids), 0, 0.0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        window = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            logp = torch.log_softmax(model(window).logits[0, :-1].double(), -1)   # predicts window[1:]
        targets = window[0, 1:]
        k = min(end - prev_end, len(targets))
        nll -= float(logp[torch.arange(len(targets)), targets][-k:].sum())
        n += k
        prev_end = end
        if end == seq_len:
            break
    return nll, n


def wiki_articles():
    with open(os.path.join(DATA, "wiki_demo.txt"), encoding="utf-8") as fh:
        return [line.strip() for line in fh.read().split("\n") if line.strip()]


def test_ppl_on_wikipedia_text_equals_transformers_and_lm_eval_rolling(smollm2_dir, hf, tmp_path, capsys):
    from msllm.eval.runner import run_eval

    model, tok = hf
    articles = wiki_articles()
    whole = tok.encode(articles[1])
    two_windows = tok.decode(whole[:2 * PPL_LENGTH])       # exactly two full windows of tokens
    assert tok.encode(two_windows) == whole[:2 * PPL_LENGTH]
    texts = [articles[0][:3000],       # 615 tokens: windows of 256, 256 and 103 scored tokens
             two_windows,              # 512 tokens: two full windows
             articles[2][:400]]        # one window
    path = tmp_path / "wiki.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    cfg = run_config(smollm2_dir, PPL_LENGTH, tmp_path / "out")
    payload = run_eval(cfg, task="ppl", data=str(path), stride=PPL_LENGTH, batch_size=4, max_length=PPL_LENGTH)
    assert payload["max_length"] == PPL_LENGTH and payload["stride"] == PPL_LENGTH and not payload["add_bos_token"]
    assert "ppl: tokens" in capsys.readouterr().out and os.path.isfile(payload["results_file"])

    lm = hflm(hf, PPL_LENGTH)
    rolling = lm.loglikelihood_rolling(instances([(t,) for t in texts], "loglikelihood_rolling"), disable_tqdm=True)
    nll_all = n_all = 0.0
    for d, (text, doc) in enumerate(zip(texts, payload["docs"])):
        ids = [lm.prefix_token_id] + lm.tok_encode(text)     # lm-eval's rolling: the prefix token, then the text
        ref_nll, ref_n = guide_nll(model, ids, PPL_LENGTH + 1, PPL_LENGTH)
        print(f"doc {d}: {doc['tokens']} tokens, msllm nll {doc['nll_sum']:.6f}, transformers {ref_nll:.6f}, "
              f"lm-eval rolling {-rolling[d]:.6f}")
        assert doc["tokens"] == ref_n == len(ids) - 1                      # every token once
        assert abs(doc["nll_sum"] - ref_nll) / ref_nll < TOL
        if d > 0:   # whole windows: lm-eval's rolling windows are msllm's
            assert abs(doc["nll_sum"] + rolling[d]) / -rolling[d] < TOL
        nll_all, n_all = nll_all + ref_nll, n_all + ref_n
    r = payload["results"]
    assert r["tokens"] == n_all and abs(r["nll_sum"] - nll_all) / nll_all < TOL
    assert r["ppl"] == pytest.approx(np.exp(nll_all / n_all), rel=TOL)


def test_mmlu_5shot_loglikelihoods_equal_lm_eval(smollm2_dir, hf, tmp_path):
    from msllm.data.tokenizer import load_tokenizer
    from msllm.eval.requests import bos_rule, encode_pair
    from msllm.eval.runner import run_eval
    from msllm.eval.tasks import mmlu

    data = tmp_path / "mmlu"
    for split in ("dev", "test"):
        (data / split).mkdir(parents=True)
        for s in SUBJECTS:
            shutil.copy(os.path.join(EVAL_DATA, "mmlu", split, f"{s}_{split}.csv"), data / split)
    # a training YAML's short seq_length (issue #31: it used to truncate the 5-shot prompts): the
    # context of an HF directory is its positions, as lm-eval's HFLM takes them when not told
    cfg = run_config(smollm2_dir, 256, tmp_path / "out")
    payload = run_eval(cfg, task="mmlu", data=str(data), num_fewshot=5, limit=3, batch_size=3)
    lm = hflm(hf, None)
    assert payload["max_length"] == lm.max_length == 8192
    assert payload["num_fewshot"] == 5 and not payload["add_bos_token"]
    assert sorted(payload["subjects"]) == sorted(SUBJECTS)

    spec = mmlu.load(str(data), 5, 3)
    assert len(spec.docs) == len(payload["docs"]) == 6
    pairs = [(doc.context, c) for doc in spec.docs for c in doc.continuations]
    tok = load_tokenizer(smollm2_dir, 0)
    bos, prefix = bos_rule(tok)
    lengths = []
    for ctx, cont in pairs:   # the same token ids as the harness's _encode_pair
        enc = encode_pair(tok.encode, bos, ctx, cont, prefix)
        assert enc == lm._encode_pair(ctx, cont)
        lengths.append(len(enc[0]) + len(enc[1]))
    print(f"mmlu: {len(pairs)} requests of {min(lengths)}-{max(lengths)} tokens")
    ref = lm.loglikelihood(instances(pairs), disable_tqdm=True)
    ours = [(ll, g) for d in payload["docs"] for ll, g in zip(d["loglikelihoods"], d["is_greedy"])]
    assert len(ours) == len(ref)
    diffs = np.array([abs(a[0] - b[0]) for a, b in zip(ours, ref)])
    print(f"mmlu: max |loglikelihood diff| {diffs.max():.2e}")
    assert diffs.max() < TOL
    assert [a[1] for a in ours] == [bool(b[1]) for b in ref]
    k = 0
    for d in payload["docs"]:   # the harness's process_results: argmax of the loglikelihoods
        lls = [ref[k + c][0] for c in range(len(d["loglikelihoods"]))]
        k += len(lls)
        assert d["pred"] == int(np.argmax(lls)) and d["acc"] == float(d["pred"] == d["gold"])
    assert payload["results"]["acc"] == pytest.approx(np.mean([d["acc"] for d in payload["docs"]]), abs=0)
