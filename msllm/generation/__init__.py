"""Text generation with a key/value cache: settings, logits processors, decoding, predict and chat.

Modules: ``config`` (settings, resolution, checks), ``processors`` (temperature, top-k, top-p,
repetition penalty, sampling), ``decode`` (prefill + cached decode loop, left-padded batches),
``beam`` (beam search), ``loading`` (model + weights for inference), ``prompts`` (``--predict_data``
and templates), ``predict`` (``run_mode: predict``), ``chat`` (the session behind
``tools/chat.py``), ``api`` (the Python API). See docs/generation.md.

``generate``, ``generate_text`` and ``load_for_inference`` are imported lazily: the run-config
schema imports :mod:`msllm.config_generation`, which must stay free of MindSpore.
"""

from msllm.config_generation import DecodeSettings, GenerationConfig

__all__ = ["GenerationConfig", "DecodeSettings", "generate", "generate_text", "load_for_inference"]


def __getattr__(name):
    if name in ("generate", "generate_text"):
        from msllm.generation import api

        return getattr(api, name)
    if name == "load_for_inference":
        from msllm.generation.loading import load_for_inference

        return load_for_inference
    raise AttributeError(f"module 'msllm.generation' has no attribute {name!r}")
