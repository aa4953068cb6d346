"""The server's request defaults from the run YAML's ``generation_config`` and ``--max_tokens_default``.

vLLM does the same with a model's ``generation_config.json`` (``--generation-config auto``: its
``temperature``, ``top_p``, ``top_k`` and ``max_new_tokens`` become the defaults of requests that
leave those fields out; ``vllm/entrypoints/openai/serving_engine.py`` / ``protocol.py``
``to_sampling_params(default_max_tokens, ..., default_sampling_params)``). Here each key of the YAML
section that is set either becomes a request default, is refused at start-up naming the key (the
server cannot honour it per request), or is named in the start-up log as having no effect (with
the reason). Keys left unset keep OpenAI's defaults. ``eos_token_id`` / ``pad_token_id`` act as in
predict and chat (the server's end-of-turn ids and the pad fed to finished rows:
:func:`msllm.generation.chat.load_session`).
"""

from __future__ import annotations

from typing import Optional

from msllm.errors import MsllmError
from msllm.serving.protocol import RequestDefaults

# keys with no effect on the server, and why (named in the start-up log when set)
NO_EFFECT = {
    "use_past": "the server always decodes on the key/value cache",
    "batch_size": "the server batches continuously up to --max_batch rows",
    "length_penalty": "beam search only, which the server does not do",
    "early_stopping": "beam search only, which the server does not do",
    "seed": "each request's 'seed' seeds its own row (none: fresh entropy, as OpenAI)",
}


def request_defaults(gen, max_tokens_default: Optional[int] = None) -> tuple[RequestDefaults, list[str]]:
    """``gen``: the run config's :class:`~msllm.config_generation.GenerationConfig` (None fields =
    not set; MindFormers' inference keys written in ``model.model_config`` are already in it:
    :func:`msllm.compat.mindformers.hoist_generation_keys`). Returns the :class:`RequestDefaults`
    and one line per set key without effect.

    ``max_tokens_default`` (the flag) wins over ``generation_config.max_new_tokens``.

    Raises:
        MsllmError: a set key the server cannot honour (``repetition_penalty`` != 1: the rows do
            not keep the seen-token sets it needs; ``num_beams`` > 1; ``max_length`` /
            ``max_decode_length``: a total length, while OpenAI's ``max_tokens`` counts new tokens
            only), or ``max_tokens_default`` < 1.
    """
    from msllm.config_generation import GenerationConfig

    gen = gen if gen is not None else GenerationConfig()

    def set_(key):
        return getattr(gen, key, None) is not None

    if set_("repetition_penalty") and gen.repetition_penalty != 1.0:
        raise MsllmError(f"generation_config.repetition_penalty={gen.repetition_penalty}: the server does not "
                         "apply a repetition penalty; remove the key (or set 1.0) to serve this config")
    if set_("num_beams") and gen.num_beams != 1:
        raise MsllmError(f"generation_config.num_beams={gen.num_beams}: the server does not do beam search; "
                         "remove the key (or set 1) to serve this config")
    for key in ("max_length", "max_decode_length"):
        if set_(key):
            raise MsllmError(f"generation_config.{key}={getattr(gen, key)}: a total length has no meaning for "
                             "OpenAI's max_tokens (new tokens only); use generation_config.max_new_tokens or "
                             "--max_tokens_default")
    if max_tokens_default is not None and max_tokens_default < 1:
        raise MsllmError(f"--max_tokens_default must be >= 1, got {max_tokens_default}")
    d = RequestDefaults()
    if gen is not None:
        greedy = gen.do_sample is False
        temperature = 0.0 if greedy else (gen.temperature if gen.temperature is not None else d.temperature)
        d = RequestDefaults(temperature=float(temperature),
                            top_p=float(gen.top_p) if gen.top_p is not None else d.top_p,
                            top_k=int(gen.top_k) if gen.top_k is not None else d.top_k,
                            max_tokens=gen.max_new_tokens)
    if max_tokens_default is not None:
        d = RequestDefaults(d.temperature, d.top_p, d.top_k, int(max_tokens_default))
    notes = [f"generation_config.{k}: no effect on the server ({why})" for k, why in NO_EFFECT.items() if set_(k)]
    return d, notes


__all__ = ["request_defaults", "NO_EFFECT"]
