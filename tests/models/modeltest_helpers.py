"""Helpers of the model tests (tests/models): greedy decoding through msllm's one generation path."""

from __future__ import annotations

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
