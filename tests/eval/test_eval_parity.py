"""msllm's multiple-choice evaluation equals lm-evaluation-harness request by request.

Reference: lm-eval 0.4's ``HFLM(add_bos_token=True)`` on the same random transformers LLaMA the
msllm network was converted from, fed the same (context, continuation) ``Instance`` s. Prompts are
checked against the harness's own task YAMLs (rendered with its Jinja helper) and its samplers.
Data: the real MMLU / BoolQ / C-Eval samples under examples/data/eval.
"""

from __future__ import annotations

import os
import random
import types

import numpy as np
import pytest
import yaml

from evaltest_helpers import EVAL_DATA, instances
from msllm.eval.requests import encode_pair
from msllm.eval.runner import evaluate
from msllm.eval.tasks import boolq, ceval, common, mmlu

LM_EVAL_TASKS = os.path.join(os.path.dirname(__import__("lm_eval").__file__), "tasks")
TOL = 1e-4


def harness_yaml(*parts):
    with open(os.path.join(LM_EVAL_TASKS, *parts), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def harness_prompt(description, shots, question, tgt=" ", few="\n\n"):
    """Plain-text prompt assembled from the harness's own Message objects, as
    ``ConfigurableTask.fewshot_context`` / ``build_qa_turn`` do (lm_eval/api/task.py)."""
    from lm_eval.api.utils import Message

    msgs = [Message("system", description)] if description else []
    for q, a in shots:
        msgs += [Message("user", q, tgt), Message("assistant", a, few)]
    msgs.append(Message("user", question, ""))
    return "".join(m.to_text() for m in msgs)


def run_both(task_name, data, lm, models, tokenizer, tmp_path, **kw):
    """msllm's evaluate() and HFLM on the same requests; returns (payload, spec, reference)."""
    hf, net, cfg, _, ckpt = models
    spec = {"mmlu": mmlu, "ceval": ceval, "boolq": boolq}[task_name].load(data, kw.get("num_fewshot"), kw.get("limit"))
    pairs = [(doc.context, cont) for doc in spec.docs for cont in doc.continuations]
    for ctx, cont in pairs:  # the same token ids as the harness's _encode_pair (+ BOS)
        assert encode_pair(tokenizer.encode, tokenizer.bos_id, ctx, cont) == lm._encode_pair(ctx, cont)
    ref = lm.loglikelihood(instances(pairs), disable_tqdm=True)
    run_cfg = types.SimpleNamespace(output_dir=str(tmp_path), load_checkpoint=ckpt)
    payload = evaluate(run_cfg, task_name, data, batch_size=4, model=(net, cfg, tokenizer, 0, 1), **kw)
    return payload, spec, ref


def check_against_reference(payload, spec, ref):
    ours = [(ll, g) for d in payload["docs"] for ll, g in zip(d["loglikelihoods"], d["is_greedy"])]
    assert len(ours) == len(ref)
    diffs = np.array([abs(a[0] - b[0]) for a, b in zip(ours, ref)])
    print(f"{spec.name}: {len(ref)} requests, max |loglikelihood diff| {diffs.max():.2e}")
    assert diffs.max() < TOL
    assert [a[1] for a in ours] == [b[1] for b in ref]
    k = 0
    for d in payload["docs"]:  # the harness's process_results: argmax of the loglikelihoods
        lls = np.array([ref[k + c][0] for c in range(len(d["loglikelihoods"]))])
        k += len(lls)
        assert d["pred"] == int(np.argmax(lls))
    acc_ref = np.mean([d["pred"] == d["gold"] for d in payload["docs"]])
    assert payload["results"]["acc"] == pytest.approx(acc_ref, abs=0)


def test_mmlu_5shot_matches_lm_eval(lm, models, tokenizer, tmp_path, capsys):
    data = os.path.join(EVAL_DATA, "mmlu")
    payload, spec, ref = run_both("mmlu", data, lm, models, tokenizer, tmp_path, num_fewshot=5, limit=3)
    check_against_reference(payload, spec, ref)
    # prompts: the harness's MMLU template and description, first_n few-shot from dev
    tpl = harness_yaml("mmlu", "default", "_default_template_yaml")
    assert tpl["fewshot_split"] == "dev" and tpl["fewshot_config"]["sampler"] == "first_n"
    from lm_eval.utils import apply_template

    for subject in common.subjects(data, "test", "MMLU"):
        desc = harness_yaml("mmlu", "default", f"mmlu_{subject}.yaml")["description"]
        dev = mmlu.read_split(os.path.join(data, "dev", f"{subject}_dev.csv"))
        test = mmlu.read_split(os.path.join(data, "test", f"{subject}_test.csv"))[:3]
        render = lambda q, o: apply_template(tpl["doc_to_text"], {"question": q, "choices": o})  # noqa: E731
        shots = [(render(q, o), tpl["doc_to_choice"][g]) for q, o, g, _ in dev[:5]]
        want = [harness_prompt(desc, shots, render(q, o)) for q, o, _, _ in test]
        assert [d.context for d in spec.docs if d.subject == subject] == want
    assert payload["subjects"] and len(payload["subjects"]) == 4
    out = capsys.readouterr().out
    assert "mmlu: acc" in out and "high_school_geography" in out and os.path.isfile(payload["results_file"])


def test_mmlu_with_the_head_at_every_position_matches_lm_eval(lm, models, tokenizer, tmp_path):
    """``dense_head`` (the like-for-like benchmark switch: the head over every position, as HFLM,
    then the queried rows picked) gives the harness's numbers too."""
    data = os.path.join(EVAL_DATA, "mmlu")
    payload, spec, ref = run_both("mmlu", data, lm, models, tokenizer, tmp_path, num_fewshot=5, limit=2,
                                  dense_head=True)
    assert payload["dense_head"] is True
    check_against_reference(payload, spec, ref)


def test_mmlu_prefix_cache_and_plain_path_agree(models, tokenizer):
    """The shared-prefix path (few-shot examples run once through the KV cache) and the plain path
    give the same scores (float rounding only)."""
    from msllm.eval.requests import build_rows
    from msllm.eval.scoring import score_rows, scorer_for

    _, net, cfg, _, _ = models
    spec = mmlu.load(os.path.join(EVAL_DATA, "mmlu"), 5, 2)
    enc = [encode_pair(tokenizer.encode, tokenizer.bos_id, d.context, c) for d in spec.docs for c in d.continuations]
    rows = build_rows(enc, cfg.seq_length)
    assert len(rows) == len(spec.docs)  # one forward row per question for its 4 single-token answers
    cached = scorer_for(net, 4, 0, 32)
    assert any(item.prefix > 300 for item in cached.plan(rows))
    a = score_rows(cached, rows)
    b = score_rows(scorer_for(net, 4, 0, 0), rows)
    assert max(abs(a[k][0] - b[k][0]) for k in a) < 2e-5


def test_boolq_0shot_and_2shot_match_lm_eval(lm, models, tokenizer, tmp_path):
    src = os.path.join(EVAL_DATA, "boolq", "dev.jsonl")
    payload, spec, ref = run_both("boolq", os.path.dirname(src), lm, models, tokenizer, tmp_path, limit=8)
    check_against_reference(payload, spec, ref)
    tpl = harness_yaml("super_glue", "boolq", "default.yaml")
    from lm_eval.utils import apply_template

    records = [rec for rec, _ in boolq.read(src)]
    assert [d.context for d in spec.docs] == [apply_template(tpl["doc_to_text"], r) for r in records[:8]]
    assert [d.gold for d in spec.docs] == [int(r["answer"]) for r in records[:8]]
    assert spec.docs[0].continuations == [" " + c for c in tpl["doc_to_choice"]]
    # 2-shot: a training split made of the sample's last 40 questions; the harness's default
    # sampler (Random(1234), n + 1 drawn, the evaluated doc dropped) picks the same examples
    d2 = tmp_path / "boolq2"
    d2.mkdir()
    lines = open(src, encoding="utf-8").read().splitlines()
    (d2 / "dev.jsonl").write_text("\n".join(lines[:10]) + "\n", encoding="utf-8")
    (d2 / "train.jsonl").write_text("\n".join(lines[10:]) + "\n", encoding="utf-8")
    payload2, spec2, ref2 = run_both("boolq", str(d2), lm, models, tokenizer, tmp_path, num_fewshot=2)
    check_against_reference(payload2, spec2, ref2)
    from lm_eval.api.samplers import ContextSampler

    train = [rec for rec, _ in boolq.read(str(d2 / "train.jsonl"))]
    sampler = ContextSampler(train, rnd=1234)
    for doc, rec in zip(spec2.docs, records[:10]):
        shots = sampler.sample(2, eval_doc=rec)
        want = harness_prompt("", [(apply_template(tpl["doc_to_text"], s), tpl["doc_to_choice"][int(s["answer"])])
                                   for s in shots], apply_template(tpl["doc_to_text"], rec))
        assert doc.context == want


def test_ceval_matches_lm_eval(lm, models, tokenizer, tmp_path):
    data = os.path.join(EVAL_DATA, "ceval")
    payload, spec, ref = run_both("ceval", data, lm, models, tokenizer, tmp_path, num_fewshot=1)
    check_against_reference(payload, spec, ref)
    tpl = harness_yaml("ceval", "_default_ceval_yaml")
    desc = harness_yaml("ceval", "ceval-valid_computer_network.yaml")["description"]
    from lm_eval.utils import apply_template

    dev = ceval.read_split(os.path.join(data, "dev", "computer_network_dev.csv"))
    val = ceval.read_split(os.path.join(data, "val", "computer_network_val.csv"))
    render = lambda q, o: apply_template(tpl["doc_to_text"], dict(zip("ABCD", o), question=q))  # noqa: E731
    want = harness_prompt(desc, [(render(dev[0][0], dev[0][1]), "A")], render(val[0][0], val[0][1]))
    assert spec.docs[0].context == want and spec.docs[0].gold == 2
    assert set(payload["results"]) >= {"acc", "acc_norm"}


def test_left_truncation_matches_lm_eval(models, tokenizer, tmp_path):
    """Contexts longer than max_length are cut from the left exactly as HFLM does."""
    from evaltest_helpers import hflm

    from msllm.eval.requests import build_rows
    from msllm.eval.scoring import score_rows, scorer_for

    hf, net, cfg, _, _ = models
    short = hflm(hf)
    short._max_length = 48
    pairs = [("Statement 1 | " * 20 + "Answer:", " A"), ("word " * 60 + "end", " of the story")]
    ref = short.loglikelihood(instances(pairs), disable_tqdm=True)
    enc = [encode_pair(tokenizer.encode, tokenizer.bos_id, c, x) for c, x in pairs]
    rows = build_rows(enc, 48)
    assert all(len(r.tokens) == 48 for r in rows)
    got = score_rows(scorer_for(net, 4, 0, 0), rows)
    assert max(abs(got[i][0] - ref[i][0]) for i in range(2)) < TOL


def test_random_sampler_mirrors_lm_eval():
    from lm_eval.api.samplers import ContextSampler

    from msllm.eval.tasks.common import RandomSampler

    pool = [{"q": i} for i in range(30)]
    ours, theirs = RandomSampler(pool, "x"), ContextSampler(pool, rnd=1234)
    ours_x, theirs_x = RandomSampler(pool, "x", exclude_doc=True), ContextSampler(pool, rnd=1234)
    for k in range(20):
        n = random.Random(k).randint(0, 6)
        assert ours.sample(n) == theirs.sample(n)
        assert ours_x.sample(n, pool[k]) == theirs_x.sample(n, eval_doc=pool[k])


def test_own_multiple_choice_jsonl_matches_lm_eval(lm, models, tokenizer, tmp_path):
    """The simple JSONL form (any number of choices, letter or index answers) scores like the
    harness, with acc_norm by choice length in characters."""
    hf, net, cfg, _, ckpt = models
    path = tmp_path / "own.jsonl"
    recs = [{"question": "Which planet is largest?", "choices": ["Mars", "Jupiter", "Venus"], "answer": 1},
            {"question": "2 + 2 =", "choices": ["4", "22"], "answer": "A", "subject": "math"},
            {"question": "Pick the colour of the sky  on a clear day.", "choices": ["blue", "green", "red", "black", "white"],
             "answer": "A"}]
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in recs), encoding="utf-8")
    from msllm.eval.tasks import mc_jsonl

    spec = mc_jsonl.load(str(path))
    assert spec.docs[0].context == "Which planet is largest?\nA. Mars\nB. Jupiter\nC. Venus\nAnswer:"
    pairs = [(d.context, c) for d in spec.docs for c in d.continuations]
    ref = lm.loglikelihood(instances(pairs), disable_tqdm=True)
    run_cfg = types.SimpleNamespace(output_dir=str(tmp_path), load_checkpoint=ckpt)
    payload = evaluate(run_cfg, "mc", str(path), batch_size=4, model=(net, cfg, tokenizer, 0, 1))
    check_against_reference(payload, spec, ref)
    k = 0
    for d, doc in zip(payload["docs"], spec.docs):
        lls = np.array([ref[k + c][0] for c in range(len(doc.choices))])
        k += len(lls)
        norm = int(np.argmax(lls / np.array([len(c) for c in doc.choices], float)))
        assert d["acc_norm"] == float(norm == doc.gold)
