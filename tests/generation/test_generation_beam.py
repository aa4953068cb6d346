"""Beam search against transformers' ``generate(num_beams=4)``: the returned sequences are the
same and their scores (HF ``sequences_scores``) agree to 1e-4, for a batch of three real
sentences of different lengths, with and without EOS stops (beams finishing early), with
``length_penalty`` 1.0 (and 2.0 / -1.0, ``early_stopping`` True / "never", which take the other
branches of HF's stopping heuristics), with and without the KV cache."""

import dataclasses

import numpy as np
import pytest

from gentest_helpers import CASES, hf_generate, hf_new_tokens, net_from_hf_dir, prompts_for, same_tokens
from msllm.convert.verify import make_random_hf_model
from msllm.config_generation import GenerationConfig, resolve_settings
from msllm.generation.decode import generator_for

NEW = 32


@pytest.mark.parametrize("case", ["mha_untied_vocab32000", "gqa_tied_theta5e5"])
def test_beam_search_matches_transformers(tmp_path, tokenizer, case):
    kw, fmt, dtype = CASES[case]
    seed = 31 + len(case)
    print("case", case, "seed", seed)
    hf = make_random_hf_model(str(tmp_path / "hf"), seed=seed, dtype=dtype, fmt=fmt, **kw)
    net, mc, _ = net_from_hf_dir(str(tmp_path / "hf"))
    prompts = prompts_for(tokenizer, kw["vocab_size"])
    gen = generator_for(net, mc)
    runs = [(dict(length_penalty=1.0), None), (dict(length_penalty=1.0), "early"),
            (dict(length_penalty=2.0, early_stopping=True), "early"),
            (dict(length_penalty=-1.0, early_stopping="never"), "early")]
    if case != "mha_untied_vocab32000":   # the other config: the default settings only (time)
        runs = [runs[0], runs[3]]
    finished_early = 0
    early_eos = None
    for extra, eos in runs:
        eos = early_eos if eos == "early" else eos
        eos_ids = [] if eos is None else [eos]
        s = resolve_settings(GenerationConfig(max_new_tokens=NEW, num_beams=4, eos_token_id=eos_ids, **extra), mc)
        res = gen.generate(prompts, s)
        out, length = hf_generate(hf, prompts, max_new_tokens=NEW, do_sample=False, num_beams=4,
                                  eos_token_id=eos, output_scores=True, **extra)
        ref = hf_new_tokens(out, length)
        fill = eos if eos is not None else -1      # HF fills finished beams with pad_token_id or eos[0]
        for row in range(3):
            assert same_tokens(res.tokens[row], ref[row], fill), (extra, eos, row, res.tokens[row], ref[row])
        ref_scores = out.sequences_scores.numpy()
        print(extra, "eos", eos, "scores", res.scores, "max diff", np.abs(np.array(res.scores) - ref_scores).max(),
              "lengths", [len(t) for t in res.tokens])
        # score = sum of the row's log-probs / length ** length_penalty: bound that sum at 1e-4
        # (+1e-6 relative), so length_penalty -1 (score = sum x length) does not multiply the
        # float32 rounding of another CPU's GEMMs by the length (AMD Zen 4: 4.4e-6 x 32 = 1.4e-4)
        scale = np.array([max(len(t), 1) for t in res.tokens], np.float64) ** extra["length_penalty"]
        np.testing.assert_allclose(np.array(res.scores) * scale, ref_scores * scale, rtol=1e-6, atol=1e-4)
        finished_early += sum(len(t) < NEW for t in res.tokens)
        if early_eos is None:  # EOS := the best beam's 4th token: hypotheses then finish at step 4
            early_eos = res.tokens[0][3]
    assert finished_early > 0          # the EOS runs did exercise early-finished hypotheses
    assert [k for k, *_ in gen.shapes] == ["prefill", "decode"]   # B = 3 x 4 beams: compiled once

    s = resolve_settings(GenerationConfig(max_new_tokens=NEW, num_beams=4, eos_token_id=[early_eos]), mc)
    cached = gen.generate(prompts, s)
    nocache = gen.generate(prompts, dataclasses.replace(s, use_past=False))
    assert nocache.tokens == cached.tokens
    np.testing.assert_allclose(nocache.scores, cached.scores, atol=1e-4)
