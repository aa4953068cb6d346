"""The Python API: token-level :func:`generate`, text-level :func:`generate_text`, and
:class:`TextStream` (incremental text of a token stream).

    import mindspore as ms
    from msllm.generation import GenerationConfig, generate, generate_text
    ms.set_device("CPU"); ms.set_context(mode=ms.GRAPH_MODE)
    out = generate(net, [[1, 306, 5360, 1522]], GenerationConfig(max_new_tokens=20))
    out.tokens[0]            # new token ids of row 0 (list of int)
    texts = generate_text(net, tokenizer, ["I love Beijing, because"], GenerationConfig(max_new_tokens=20))

``net`` is a :class:`~msllm.models.llama.model.LlamaForCausalLM` with weights loaded (e.g. by
:func:`msllm.generation.loading.load_for_inference`). Graphs are compiled on the first call of
each shape and kept with the network, so later calls of the same batch size and lengths are fast.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from msllm.config_generation import DecodeSettings, GenerationConfig, resolve_settings
from msllm.generation.decode import GenerationResult, StreamFn, generator_for
from msllm.generation.stepping import TextStream, decode_new  # noqa: F401 (part of this API)


def settings_for(model, config: Union[GenerationConfig, DecodeSettings, None]) -> DecodeSettings:
    """``config`` resolved against ``model.config`` (its EOS / pad ids, MindFormers keys)."""
    if isinstance(config, DecodeSettings):
        return config
    return resolve_settings(config, model.config)


def generate(model, input_ids, config: Union[GenerationConfig, DecodeSettings, None] = None,
             stream: Optional[StreamFn] = None, keep_logits: bool = False) -> GenerationResult:
    """Continue token-id prompts.

    Args:
        model: ``LlamaForCausalLM`` (weights loaded; any execution mode, GRAPH_MODE compiles).
        input_ids: B prompts of any lengths: a list of lists of int, one list of int (B = 1), or
            an int array (B, T) of unpadded prompts of equal length. Rows are left-padded and
            masked internally, so each row's output is what it would be alone.
        config: :class:`GenerationConfig` (unset fields resolve as in
            :func:`~msllm.config_generation.resolve_settings`: HF defaults, model EOS/pad) or
            resolved :class:`DecodeSettings`.
        stream: called after every step with (step, tokens (B,) int64, finished (B,) bool);
            return True to stop.
        keep_logits: also return the raw (B, V) float32 logits of every step.

    Returns:
        :class:`~msllm.generation.decode.GenerationResult`: ``tokens`` (per row, list of new
        token ids, EOS included when it stopped there), ``finish_reasons`` (``eos`` / ``length`` /
        ``stop``), ``scores`` (beam search), timings.

    Raises:
        MsllmError: bad settings, an empty prompt, a prompt longer than the context window.
    """
    if isinstance(input_ids, np.ndarray):
        input_ids = input_ids.tolist() if input_ids.ndim == 2 else [input_ids.tolist()]
    elif input_ids and isinstance(input_ids[0], (int, np.integer)):
        input_ids = [list(input_ids)]
    return generator_for(model).generate(input_ids, settings_for(model, config), stream=stream,
                                         keep_logits=keep_logits)


def generate_text(model, tokenizer, prompts: Union[str, Sequence[str]],
                  config: Union[GenerationConfig, DecodeSettings, None] = None, template=None) -> list[str]:
    """Continue text prompts: each is tokenised with BOS (or formatted as one user turn by
    ``template``, :func:`msllm.generation.prompts.encode_turns`), generated with :func:`generate`,
    and the new tokens decoded (EOS dropped; cut at the template's stop strings).

    ``tokenizer``: :class:`msllm.data.tokenizer.LlamaTokenizer`. Returns one string per prompt."""
    from msllm.data.conversation import HUMAN
    from msllm.generation.prompts import cut_at_stop, encode_turns, stop_strings

    if isinstance(prompts, str):
        prompts = [prompts]
    ids = [encode_turns(tokenizer, template, [(HUMAN, p)]) for p in prompts]
    s = settings_for(model, config)
    out = generate(model, ids, s)
    return [cut_at_stop(decode_new(tokenizer, t, s.eos_token_id), stop_strings(template))[0] for t in out.tokens]


