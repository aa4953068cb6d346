"""Helpers of the model tests (tests/models): greedy decoding through msllm's one generation path; real
Alpaca conversations tokenized for SmolLM2."""

from __future__ import annotations

import json
import os

import numpy as np


def greedy_logits(net, cfg, prompts: list, steps: int = 6, buffer: int = 32):
    """Prefill ``prompts`` (token-id lists, left-padded into one batch of ``buffer`` cache slots), then
    ``steps`` greedy decode steps with ``msllm.generation.decode.Generator``: (every step's logits
    (steps + 1, B, V) float32, the greedy tokens (steps, B) int)."""
    from msllm.generation.decode import Generator

    gen = Generator(net, cfg)
    length = max(map(len, prompts))
    logits, caches, pads = gen.prefill(prompts, length, buffer, 0)
    out, toks = [logits], []
    for step in range(steps):
        tok = logits.argmax(-1)
        toks.append(tok)
        logits, caches = gen.decode_step(tok, length + step, pads, buffer, caches)
        out.append(logits)
    return np.stack(out), np.stack(toks)


def smollm2_samples(smollm2_dir, n=4, limit=96):
    """(input_ids, labels) of the first ``n`` bundled Alpaca records, rendered with SmolLM2's chat
    template and cut to ``limit`` tokens (the sample builder's truncation), as preprocessing does."""
    from msllm.data.conversation import alpaca_to_conversation, validate_conversation_records
    from msllm.data.samples import build_qa_samples
    from msllm.data.templates import resolve_template
    from msllm.data.tokenizer import load_tokenizer

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "examples", "data", "alpaca_en_demo.json"), encoding="utf-8") as fh:
        records = json.load(fh)[:n]
    conv = validate_conversation_records(alpaca_to_conversation(records, "alpaca"), "alpaca")
    tok = load_tokenizer(smollm2_dir)
    res = build_qa_samples(tok, conv, limit - 1, resolve_template("chat_template", tok))
    return [(r.input_ids, r.labels) for r in res]
