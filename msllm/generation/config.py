"""``generation_config``: decoding settings with Hugging Face's names (``GenerationConfig``).

Every field defaults to ``None`` = "not set here": the value then comes from the MindFormers keys
in ``model.model_config`` (``do_sample``, ``top_k``, ``top_p``, ``repetition_penalty``,
``max_decode_length``, ``use_past``), else from Hugging Face's default
(``transformers/generation/configuration_utils.py``). Command-line overrides use the same names
(``--generation_config.top_k=5``). This module imports nothing heavy: the run config schema
(:mod:`msllm.config`) includes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass
class GenerationConfig:
    """Decoding settings (HF names; MindFormers' ``max_decode_length`` is HF's ``max_length``).

    max_new_tokens: tokens to generate after the prompt.
    max_length / max_decode_length: total length (prompt + new tokens); ``max_new_tokens`` wins.
    do_sample: sample (True) or greedy / beam search (False).
    temperature, top_k, top_p, repetition_penalty: logits processors, as HF applies them.
    num_beams, length_penalty: beam search (``num_beams > 1``, no sampling).
    eos_token_id: one id or a list; generation of a row stops at any of them.
    pad_token_id: id used for left padding and for finished rows.
    seed: seed of the sampler (numpy ``default_rng``); ``None`` = the run's ``seed``.
    use_past: decode with a key/value cache (MindFormers' key; default on for predict/chat/eval).
    batch_size: prompts decoded together (predict files).
    """

    max_new_tokens: Optional[int] = None
    max_length: Optional[int] = None
    max_decode_length: Optional[int] = None
    do_sample: Optional[bool] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    num_beams: Optional[int] = None
    length_penalty: Optional[float] = None
    eos_token_id: Optional[Union[int, list]] = None
    pad_token_id: Optional[int] = None
    seed: Optional[int] = None
    use_past: Optional[bool] = None
    batch_size: Optional[int] = None
