"""GSM8K: msllm's greedy generations equal lm-eval's HFLM.generate_until (transformers' generate)
on the same random model, and the extracted answers / exact match equal the harness's filters."""

from __future__ import annotations

import os
import types

import pytest

from evaltest_helpers import EVAL_DATA, instances
from msllm.eval.runner import evaluate
from msllm.eval.tasks import gsm8k

MAX_GEN = 20


def test_gsm8k_generations_match_lm_eval(lm, models, tokenizer, tmp_path):
    hf, net, cfg, _, ckpt = models
    data = os.path.join(EVAL_DATA, "gsm8k")
    # 2-shot from a training split made of the sample's last questions (the bundle has no train split)
    d = tmp_path / "gsm"
    d.mkdir()
    lines = open(os.path.join(data, "test.jsonl"), encoding="utf-8").read().splitlines()
    (d / "test.jsonl").write_text("\n".join(lines[:5]) + "\n", encoding="utf-8")
    (d / "train.jsonl").write_text("\n".join(lines[5:]) + "\n", encoding="utf-8")
    spec = gsm8k.load(str(d), 2, None)
    kwargs = {"until": list(gsm8k.UNTIL), "do_sample": False, "temperature": 0.0, "max_gen_toks": MAX_GEN}
    ref = lm.generate_until(instances([(doc.context, dict(kwargs)) for doc in spec.docs], "generate_until"),
                            disable_tqdm=True)
    run_cfg = types.SimpleNamespace(output_dir=str(tmp_path), load_checkpoint=ckpt)
    payload = evaluate(run_cfg, "gsm8k", str(d), num_fewshot=2, batch_size=3, max_gen_toks=MAX_GEN,
                       model=(net, cfg, tokenizer, 0, 1))
    ours = [doc["generation"] for doc in payload["docs"]]
    print("generations:", [g[:40] for g in ours])
    assert ours == ref
    assert all(len(doc["tokens"]) >= 1 for doc in payload["docs"])
    # the harness's filters on those generations
    from lm_eval.filters.extraction import RegexFilter

    strict = RegexFilter(r"#### (\-?[0-9\.\,]+)", 0).apply([[g] for g in ref], None)
    flex = RegexFilter(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1).apply([[g] for g in ref], None)
    for rec, s, f in zip(payload["docs"], strict, flex):
        assert (rec["strict"], rec["flexible"]) == (s[0], f[0])


HAND = ["The answer is 18.\n#### 18", "so 1,000 dollars #### 1,000", "I think $42.", "#### -3.5",
        "no number here", "first 12 then 7.5 and finally 30", "#### 72\n\nQuestion: next", "3 apples and 4"]


@pytest.mark.parametrize("text", HAND)
def test_gsm8k_extraction_and_exact_match_equal_the_harness(text):
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter
    from lm_eval.models.utils import postprocess_generated_text

    cut = gsm8k.cut_at_stop(text, list(gsm8k.UNTIL) + ["</s>"])
    assert cut == postprocess_generated_text(text, list(gsm8k.UNTIL) + ["</s>"], None)
    target = "Some reasoning <<6*3=18>>\n#### 18"
    ours = gsm8k.score(cut, target)
    kw = dict(regexes_to_ignore=[",", "\\$", "(?s).*#### ", "\\.$"], ignore_case=True, ignore_punctuation=False)
    for name, regex, group in (("strict", r"#### (\-?[0-9\.\,]+)", 0),
                               ("flexible", r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1)):
        pred = RegexFilter(regex, group).apply([[cut]], None)[0][0]
        assert ours[name] == pred
        em = exact_match_hf_evaluate([pred], [target], **kw)["exact_match"]
        key = "exact_match,strict-match" if name == "strict" else "exact_match,flexible-extract"
        assert ours[key] == em
