"""Greedy decoding token for token against transformers' ``generate(do_sample=False)``.

For each conversion test config (MHA, GQA + tied embeddings + rope_theta 5e5, GQA + linear rope
scaling, MQA stored in bf16) a random transformers LLaMA is saved, loaded through the inference
loader (HF directory -> msllm in memory), and a batch of three real sentences of different lengths
(real LLaMA tokenizer) is continued by 32 tokens: msllm's tokens equal HF's, the logits of every
step agree to 1e-4, and the tokens are the same without the KV cache and when a row is decoded
alone (the most-padded row; every row for the sliding-window case). GRAPH_MODE: the decode step compiles once (MindSpore's own compile cache is checked).
"""

import dataclasses

import numpy as np
import pytest

from gentest_helpers import (CASES, hf_generate, hf_new_tokens, max_logit_diff, net_from_hf_dir, prompts_for,
                             same_tokens)
from msllm.convert.verify import make_random_hf_model
from msllm.config_generation import GenerationConfig, resolve_settings
from msllm.generation.decode import generator_for

NEW = 32
ALL_ROWS_ALONE = "mistral_window16"


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(tmp_path, tokenizer, case):
    kw, fmt, dtype = CASES[case]
    seed = sorted(CASES).index(case) + 11
    print("case", case, "seed", seed)
    hf = make_random_hf_model(str(tmp_path / "hf"), seed=seed, dtype=dtype, fmt=fmt, **kw)
    # MoE: transformers 5.24's generate with output_router_logits computes the load-balancing term
    # with the attention mask and fails on a cached step (a shape error); it changes no logit
    hf.config.output_router_logits = False
    net, mc, _ = net_from_hf_dir(str(tmp_path / "hf"))
    prompts = prompts_for(tokenizer, kw["vocab_size"])
    assert len({len(p) for p in prompts}) == 3

    out, length = hf_generate(hf, prompts, max_new_tokens=NEW, do_sample=False, output_logits=True)
    ref = hf_new_tokens(out, length)

    gen = generator_for(net, mc)
    s = resolve_settings(GenerationConfig(max_new_tokens=NEW), mc)
    assert (s.do_sample, s.num_beams, s.eos_token_id, s.use_past) == (False, 1, (2,), True)
    res = gen.generate(prompts, s, keep_logits=True)
    for row in range(3):
        assert same_tokens(res.tokens[row], ref[row], 0), (row, res.tokens[row], ref[row])
    assert res.finish_reasons == ["eos" if t and t[-1] == 2 else "length" for t in res.tokens]
    active = np.array([[k < len(t) for t in res.tokens] for k in range(len(res.logits))])
    diff = max_logit_diff(res.logits, out.logits, active)
    spread = float(np.std(res.logits[0]))
    print(f"{case}: max |logit diff| over {len(res.logits)} steps {diff:.2e} (logit std {spread:.2f})")
    assert diff < 1e-4 and spread > 0.3

    # one prefill and one decode graph for the batch: the decode step compiled once for all steps, in
    # the cell that holds the batch's kept cache set (msllm/generation/bound_caches.py)
    assert [k for k, *_ in gen.shapes] == ["prefill", "decode"]
    (kept,) = gen.kept.by_shape.values()
    assert len(gen.prefill_step.compile_cache) == 1 and len(kept.cell.compile_cache) == 1
    assert res.steps == max(len(t) for t in res.tokens) - 1

    nocache = gen.generate(prompts, dataclasses.replace(s, use_past=False))
    assert nocache.tokens == res.tokens

    # an independent reference inside msllm: the training forward (net.logits: construct's path, no
    # cache code at all) over each row's prompt + generated tokens: every generated token is the
    # argmax at its prefix, with the decode step's logits
    from mindspore import Tensor

    # (one graph for the three rows: each row right-padded with token 0 to the longest, which a causal model's
    # earlier positions cannot see)
    seqs = [list(p) + res.tokens[row] for row, p in enumerate(prompts)]
    width = max(len(q) for q in seqs)
    full = net.logits(Tensor(np.array([q + [0] * (width - len(q)) for q in seqs], np.int32))).asnumpy()   # (3, T, V)
    for row, p in enumerate(prompts):
        for k, tok in enumerate(res.tokens[row]):
            at = full[row, len(p) - 1 + k]
            assert int(np.argmax(at)) == tok, (row, k)
            assert np.abs(at - res.logits[k][row]).max() < 1e-4, (row, k)

    # each row alone: padding changes nothing. Every row for the sliding-window case (padding and window
    # interact); elsewhere the shortest prompt, the row the batch pads most (each alone-run compiles two graphs)
    alone = range(3) if case == ALL_ROWS_ALONE else [int(np.argmin([len(p) for p in prompts]))]
    for row in alone:
        assert gen.generate([prompts[row]], s).tokens[0] == res.tokens[row]


def test_rows_stop_at_eos_and_the_batch_at_the_last_one(tmp_path, tokenizer):
    """An EOS id that row 0 produces early and the other rows never (and a second, unused one): row 0
    stops there, keeps its EOS, the other rows go on to the length limit; HF's output (EOS, then
    padding) is the same."""
    kw, fmt, dtype = CASES["mha_untied_vocab32000"]
    hf = make_random_hf_model(str(tmp_path / "hf"), seed=21, **kw)
    net, mc, _ = net_from_hf_dir(str(tmp_path / "hf"))
    prompts = prompts_for(tokenizer, kw["vocab_size"])
    gen = generator_for(net, mc)
    free = gen.generate(prompts, resolve_settings(GenerationConfig(max_new_tokens=NEW, eos_token_id=[]), mc))
    # the EOS: the first token of row 0 from step 2 on that row 0 has not made before and the other
    # rows never make, so row 0 stops there and the others run to the length limit
    others = set(free.tokens[1] + free.tokens[2])
    at = next(k for k in range(2, NEW) if free.tokens[0][k] not in others
              and free.tokens[0][k] not in free.tokens[0][:k])
    eos = free.tokens[0][at]
    s = resolve_settings(GenerationConfig(max_new_tokens=NEW, eos_token_id=[eos, 31999]), mc)
    res = gen.generate(prompts, s)
    assert res.tokens[0] == free.tokens[0][:at + 1] and res.finish_reasons[0] == "eos"
    out, length = hf_generate(hf, prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=[eos, 31999])
    ref = hf_new_tokens(out, length)
    for row in range(3):
        assert same_tokens(res.tokens[row], ref[row], 0), (row, res.tokens[row], ref[row])
    assert res.finish_reasons[1:] == ["length", "length"] and res.tokens[1:] == free.tokens[1:]
