"""``generation_config``: decoding settings with Hugging Face's names, their resolution and checks.

Every :class:`GenerationConfig` field defaults to ``None`` = "not set here". :func:`resolve_settings`
fills each one from, in order:

1. the command line (``--generation_config.top_k=5``: an override of this section, so it is
   already in the :class:`GenerationConfig`);
2. the ``generation_config`` section of the run YAML;
3. MindFormers' inference keys in ``model.model_config`` (``do_sample``, ``top_k``, ``top_p``,
   ``repetition_penalty``, ``max_decode_length``, ``use_past``; MindFormers'
   ``configs/llama2/predict_llama2_7b.yaml`` keeps them there), moved into this section when the
   YAML is read where it does not set them itself (:func:`msllm.config.hoist_generation_keys`);
4. Hugging Face's defaults (``transformers/generation/configuration_utils.py``:
   ``do_sample=False, temperature=1.0, top_k=50, top_p=1.0, repetition_penalty=1.0,
   num_beams=1, length_penalty=1.0, early_stopping=False``) and msllm's own: ``max_new_tokens``
   128 (HF's default ``max_length=20`` counts the prompt, which makes it useless for chat),
   ``use_past`` True, ``batch_size`` = ``runner_config.batch_size``, ``eos_token_id`` /
   ``pad_token_id`` from the model config.

Length: ``max_new_tokens`` wins over ``max_length`` / ``max_decode_length`` (total length, prompt
included: new tokens = that minus the padded prompt length, as HF computes it). Either way the
total is capped at the model's context window (``max_position_embeddings``): a prompt longer
than the window is an error, a prompt that leaves fewer new tokens than asked is cut short with
a log line (finish reason ``length``).

Pure Python, beside the run schema (:mod:`msllm.config` includes it); :mod:`msllm.generation`
uses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

from msllm.errors import MsllmError

log = logging.getLogger("msllm")

DEFAULT_MAX_NEW_TOKENS = 128
# Hugging Face GenerationConfig defaults (transformers/generation/configuration_utils.py)
HF_DEFAULTS = dict(do_sample=False, temperature=1.0, top_k=50, top_p=1.0, repetition_penalty=1.0,
                   num_beams=1, length_penalty=1.0, early_stopping=False)
# model.model_config keys MindFormers reads at inference: each is the GenerationConfig field of
# the same name (msllm.config.hoist_generation_keys moves them)
MINDFORMERS_KEYS = ("do_sample", "top_k", "top_p", "repetition_penalty", "max_decode_length", "use_past")


@dataclass
class GenerationConfig:
    """Decoding settings (HF names; MindFormers' ``max_decode_length`` is HF's ``max_length``).

    max_new_tokens: tokens to generate after the prompt.
    max_length / max_decode_length: total length (prompt + new tokens); ``max_new_tokens`` wins.
    do_sample: sample (True) or greedy / beam search (False).
    temperature, top_k, top_p, repetition_penalty: logits processors, as HF applies them
        (:mod:`msllm.generation.processors`); ``top_k`` 0 = off, ``top_p`` 1.0 = off.
    num_beams, length_penalty, early_stopping: beam search (``num_beams > 1``, no sampling);
        ``early_stopping`` True / False / ``"never"`` as in HF.
    eos_token_id: one id or a list; generation of a row stops at any of them.
    pad_token_id: id used for left padding and for finished rows.
    seed: seed of the sampler (numpy ``default_rng``); ``None`` = the run's ``seed``.
    use_past: decode with a key/value cache (MindFormers' key; default on for predict/chat/eval).
    batch_size: prompts decoded together (predict files); ``None`` = ``runner_config.batch_size``.
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
    early_stopping: Optional[Union[bool, str]] = None
    eos_token_id: Optional[Union[int, list]] = None
    pad_token_id: Optional[int] = None
    seed: Optional[int] = None
    use_past: Optional[bool] = None
    batch_size: Optional[int] = None

    def validate(self, where: str = "generation_config") -> None:
        """Check the values set here (at config load; the full check, with the model config's
        MindFormers keys, runs when generation starts). Raises MsllmError naming the key."""
        _check(self, where)


@dataclass(frozen=True)
class DecodeSettings:
    """Resolved decoding settings: every value concrete (see :func:`resolve_settings`).

    ``max_new_tokens`` is None only when a total ``max_length`` was given instead (then the new
    tokens depend on the prompt: :meth:`new_tokens`). ``eos_token_id`` is a tuple (possibly
    empty: no EOS stop).
    """

    max_new_tokens: Optional[int] = DEFAULT_MAX_NEW_TOKENS
    max_length: Optional[int] = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    eos_token_id: tuple = (2,)
    pad_token_id: int = 0
    seed: int = 0
    use_past: bool = True
    batch_size: int = 1

    def new_tokens(self, prompt_length: int, context: int) -> int:
        """New tokens to generate after a (padded) prompt of ``prompt_length`` tokens in a model
        whose context window is ``context`` positions.

        Raises:
            MsllmError: the prompt alone does not fit in the window, or ``max_length`` leaves no
                room for a new token.
        """
        if prompt_length >= context:
            raise MsllmError(f"the prompt is {prompt_length} tokens long, but the model's context window "
                             f"(max_position_embeddings) is {context} positions: shorten the prompt")
        if self.max_new_tokens is not None:
            want = self.max_new_tokens
        else:
            want = self.max_length - prompt_length
            if want < 1:
                raise MsllmError(f"generation_config.max_length={self.max_length} leaves no new token after a "
                                 f"{prompt_length}-token prompt: raise it or set max_new_tokens")
        room = context - prompt_length
        if want > room:
            log.warning("generation: %d new tokens asked, but a %d-token prompt leaves %d of the %d-position "
                        "context window: generating at most %d", want, prompt_length, room, context, room)
        return min(want, room)


def _first(*values):
    for v in values:
        if v is not None:
            return v
    return None


def resolve_settings(gen: Optional[GenerationConfig], model_config=None, seed: int = 0,
                     batch_size: Optional[int] = None) -> DecodeSettings:
    """The :class:`DecodeSettings` of ``gen`` (the ``generation_config`` section with command-line
    overrides applied, MindFormers' model_config keys moved in), falling back to the defaults
    (module doc) and to ``model_config``'s EOS / pad ids
    (:class:`~msllm.models.llama.config.LlamaConfig` or None).

    ``seed``: the run's seed (used when ``gen.seed`` is None); ``batch_size``: the default batch
    size (``runner_config.batch_size``; 1 when None).

    Raises:
        MsllmError: a bad value (:func:`validate_settings`), naming the key.
    """
    gen = gen or GenerationConfig()
    mc = model_config
    max_new = gen.max_new_tokens
    max_length = _first(gen.max_length, gen.max_decode_length)
    if max_new is None and max_length is None:
        max_new = DEFAULT_MAX_NEW_TOKENS
    if max_new is not None:
        max_length = None
    eos = _first(gen.eos_token_id, getattr(mc, "eos_token_id", None), 2)
    eos = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    s = DecodeSettings(
        max_new_tokens=max_new, max_length=max_length,
        do_sample=bool(_first(gen.do_sample, HF_DEFAULTS["do_sample"])),
        temperature=float(_first(gen.temperature, HF_DEFAULTS["temperature"])),
        top_k=int(_first(gen.top_k, HF_DEFAULTS["top_k"])),
        top_p=float(_first(gen.top_p, HF_DEFAULTS["top_p"])),
        repetition_penalty=float(_first(gen.repetition_penalty, HF_DEFAULTS["repetition_penalty"])),
        num_beams=int(_first(gen.num_beams, HF_DEFAULTS["num_beams"])),
        length_penalty=float(_first(gen.length_penalty, HF_DEFAULTS["length_penalty"])),
        early_stopping=_first(gen.early_stopping, HF_DEFAULTS["early_stopping"]),
        eos_token_id=eos,
        pad_token_id=int(_first(gen.pad_token_id, getattr(mc, "pad_token_id", None), 0)),
        seed=int(_first(gen.seed, seed)),
        use_past=bool(_first(gen.use_past, True)),
        batch_size=int(_first(gen.batch_size, batch_size, 1)),
    )
    validate_settings(s, getattr(mc, "vocab_size", None))
    if not s.do_sample:
        unused = [k for k in ("temperature", "top_k", "top_p") if getattr(gen, k) is not None]
        if unused:
            log.info("generation: %s have no effect without do_sample (greedy/beam search)", ", ".join(unused))
    if s.num_beams == 1 and (gen.length_penalty is not None or gen.early_stopping is not None):
        log.info("generation: length_penalty / early_stopping have no effect without num_beams > 1")
    return s


def _check(gen: GenerationConfig, where: str) -> None:
    for key in ("max_new_tokens", "max_length", "max_decode_length"):
        value = getattr(gen, key)
        if value is not None and value < 1:
            raise MsllmError(f"{where}.{key}={value}: expected >= 1")
    defaults = {k: v for k, v in HF_DEFAULTS.items()}
    values = {k: (getattr(gen, k) if getattr(gen, k) is not None else v) for k, v in defaults.items()}
    try:
        validate_settings(DecodeSettings(batch_size=gen.batch_size or 1, **values))
    except MsllmError as exc:
        raise MsllmError(str(exc).replace("generation_config", where, 1)) from None


def validate_settings(s: DecodeSettings, vocab_size: Optional[int] = None) -> None:
    """Raise one :class:`MsllmError` naming the key for a value HF would also refuse (or that
    msllm does not implement).

    Checks: ``max_new_tokens`` / ``max_length`` >= 1; ``top_p`` in (0, 1]; ``top_k`` >= 0;
    ``temperature`` > 0 when sampling; ``repetition_penalty`` > 0; ``num_beams`` >= 1 and no
    sampling with beams (beam sampling is not implemented); ``early_stopping`` True/False/"never";
    ``batch_size`` >= 1; EOS / pad ids inside the vocabulary.
    """
    where = "generation_config"
    if s.max_new_tokens is not None and s.max_new_tokens < 1:
        raise MsllmError(f"{where}.max_new_tokens={s.max_new_tokens}: expected >= 1")
    if s.max_length is not None and s.max_length < 2:
        raise MsllmError(f"{where}.max_length (or max_decode_length)={s.max_length}: expected >= 2")
    if not 0.0 < s.top_p <= 1.0:
        raise MsllmError(f"{where}.top_p={s.top_p}: expected a value in (0, 1] (1.0 = off)")
    if s.top_k < 0:
        raise MsllmError(f"{where}.top_k={s.top_k}: expected >= 0 (0 = off)")
    if s.do_sample and not s.temperature > 0.0:
        raise MsllmError(f"{where}.temperature={s.temperature}: expected > 0 with do_sample "
                         "(for deterministic output use do_sample: False)")
    if not s.repetition_penalty > 0.0:
        raise MsllmError(f"{where}.repetition_penalty={s.repetition_penalty}: expected > 0 (1.0 = off)")
    if s.num_beams < 1:
        raise MsllmError(f"{where}.num_beams={s.num_beams}: expected >= 1")
    if s.num_beams > 1 and s.do_sample:
        raise MsllmError(f"{where}: num_beams={s.num_beams} with do_sample=True (beam sampling) is not "
                         "implemented; use num_beams: 1 to sample or do_sample: False for beam search")
    if s.early_stopping not in (True, False, "never"):
        raise MsllmError(f"{where}.early_stopping={s.early_stopping!r}: expected True, False or \"never\"")
    if s.batch_size < 1:
        raise MsllmError(f"{where}.batch_size={s.batch_size}: expected >= 1")
    if vocab_size is not None:
        for key, ids in (("eos_token_id", s.eos_token_id), ("pad_token_id", (s.pad_token_id,))):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise MsllmError(f"{where}.{key}={bad[0]}: outside the model's vocabulary of {vocab_size} ids")
