"""Greedy generation for generative tasks (GSM8K), as lm-evaluation-harness v0.4.13's
``HFLM.generate_until`` (``lm_eval/models/huggingface.py``) does it:

* each context is tokenised with BOS, left-truncated to ``max_length - max_gen_toks`` tokens;
* requests are sorted longest first and batched (rows left-padded; each row decodes as if alone,
  :mod:`msllm.generation.decode`);
* greedy decoding for at most ``max_gen_toks`` new tokens, a row stopping at EOS; the batch stops
  early once every row has produced a stop string or EOS (the harness's stop criteria);
* the new tokens are decoded without special tokens and cut at the first occurrence of each stop
  string in turn (``postprocess_generated_text``); the tokenizer's EOS text is a stop string too.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def plan_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Request indices sorted longest first (ties: index), in chunks of ``batch_size``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def generate_until(net, tokenizer, contexts: Sequence[str], until: Sequence[str], max_length: int,
                   max_gen_toks: int = 256, batch_size: int = 8, rank: int = 0, world_size: int = 1,
                   progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """New token ids per context (greedy), cut at EOS; identical on every rank.

    Batches are planned from all contexts and split over data-parallel ranks by
    :func:`msllm.eval.dist.assign`; the token ids are gathered exactly (:mod:`msllm.eval.dist`).
    """
    from msllm.eval.dist import all_gather_records, assign
    from msllm.config_generation import DecodeSettings
    from msllm.generation.decode import generator_for

    max_ctx = max_length - max_gen_toks
    if max_ctx < 1:
        from msllm.errors import MsllmError

        raise MsllmError(f"max_gen_toks {max_gen_toks} leaves no room for a prompt in seq_length {max_length}")
    from msllm.eval.requests import bos_rule

    head = [] if bos_rule(tokenizer)[0] is None else [tokenizer.bos_id]
    prompts = [(head + tokenizer.encode(c))[-max_ctx:] for c in contexts]
    batches = plan_batches([len(p) for p in prompts], batch_size)
    owner = assign([max(len(prompts[i]) for i in b) * len(b) for b in batches], world_size)
    gen = generator_for(net)
    settings = DecodeSettings(max_new_tokens=max_gen_toks, do_sample=False, eos_token_id=tuple(tokenizer.eos_ids),
                              pad_token_id=int(tokenizer.pad_id), use_past=True, batch_size=batch_size)
    stops = [s for s in until if s]
    local: dict = {}
    for batch, r in zip(batches, owner):
        if r != rank:
            continue
        rows = [prompts[i] for i in batch]
        texts = [[] for _ in rows]

        def stream(step, tokens, finished, texts=texts):
            for k, t in enumerate(tokens):
                texts[k].append(int(t))
            return all(finished[k] or any(s in tokenizer.decode(texts[k]) for s in stops)
                       for k in range(len(rows)))

        out = gen.generate(rows, settings, stream=stream)
        for i, toks in zip(batch, out.tokens):
            local[i] = _until_eos(toks, tokenizer.eos_ids)
        if progress is not None:
            progress(len(batch))
    merged = all_gather_records(local, world_size)
    return [np.asarray(merged[i]).astype(np.int64).tolist() for i in range(len(contexts))]


def decode_and_cut(tokenizer, tokens: Sequence[int], until: Sequence[str]) -> str:
    """The generated text, cut at each stop string in turn (the harness's post-processing)."""
    from msllm.eval.tasks.gsm8k import cut_at_stop

    return cut_at_stop(tokenizer.decode(tokens), list(until))


def _until_eos(tokens, eos_ids) -> list:
    """``tokens`` up to (without) the first end-of-turn id."""
    cut = next((k for k, t in enumerate(tokens) if t in eos_ids), len(tokens))
    return list(tokens[:cut])
