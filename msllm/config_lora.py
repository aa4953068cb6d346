"""The run YAML's ``pet_config`` section (LoRA): the :class:`PetConfig` dataclass, its meaning and its
validation. The keys are MindFormers' (``configs/llama2/lora_llama2_7b.yaml``).

Where it lives: the top-level ``pet_config`` section of the run config
(:class:`msllm.config.RunConfig`; ``--pet_config.lora_rank=8``). MindFormers keeps it in
``model.model_config.pet_config`` (and its 0.x YAMLs in ``model.arch.pet``); a YAML or an override
may keep that place, and msllm moves it into ``pet_config`` when the YAML is read and after the
overrides (:func:`msllm.compat.mindformers.hoist_pet_config`), so the model config describes the
model only. A checkpoint manifest records it under its own ``"pet_config"`` key
(:func:`msllm.formats.manifest.manifest_pet_config` also reads manifests that kept it inside
``"model_config"``).

Pure Python (no MindSpore): the config schema can call :func:`validate_pet_config` at load time.

Semantics (each key does what it says, or is refused here with a reason):

* ``pet_type``: ``lora`` only (Hu et al. 2021). MindFormers also knows ``ptuning2``,
  ``prefix_tuning``, ``adalora``, ``slora``: msllm refuses them, naming what it has.
* ``lora_rank`` r > 0; ``lora_alpha`` > 0; the update ``B A`` is scaled by ``lora_alpha / r``
  (PEFT ``LoraLayer.update_layer`` without ``use_rslora``; MindFormers ``LoRADense``).
* ``lora_dropout`` in [0, 1): dropout on the adapter's input only, during training (PEFT applies
  ``lora_dropout`` to the input of ``lora_A``). 0 builds no dropout operator at all.
* ``target_modules``: a regex, ``re.fullmatch``-ed (as PEFT does for a string) against each
  linear module's full name in msllm/HF naming (``model.layers.0.self_attn.q_proj``) and in
  MindFormers naming (``model.layers.0.attention.wq``), and against its last component
  (``q_proj`` / ``wq``, so MindFormers' ``.*wq|.*wv`` and a bare ``q_proj|v_proj`` both work).
  A regex that matches nothing is an error listing the modules there are
  (:func:`msllm.lora.targets.match_targets`).
* ``lora_a_init``: ``kaiming_uniform`` (PEFT's default, ``init_lora_weights=True``:
  ``kaiming_uniform_(a=sqrt(5))`` = U(-1/sqrt(in), 1/sqrt(in))), ``gaussian`` (PEFT
  ``init_lora_weights="gaussian"``: N(0, 1/r)), ``normal`` (MindFormers' default, MindSpore's
  ``Normal()`` initializer: N(0, 0.01)).
* ``lora_b_init``: ``zeros`` (``zero`` accepted, MindFormers' spelling). B = 0 makes the adapted
  model start exactly equal to the base; other initialisers are refused for that reason.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

from msllm.errors import MsllmError

PET_TYPES = ("lora",)
A_INITS = ("kaiming_uniform", "gaussian", "normal")
B_INITS = ("zeros", "zero")
WHERE = "pet_config"
# where MindFormers' YAMLs keep the section; moved to WHERE when a run YAML is read
MINDFORMERS_WHERE = "model.model_config.pet_config"


@dataclass
class PetConfig:
    """``pet_config`` (top level of the run YAML; MindFormers' ``model.model_config.pet_config``):
    parameter-efficient fine-tuning (MindFormers' keys, ``configs/llama2/lora_llama2_7b.yaml``).

    pet_type: ``lora`` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").
    lora_rank: r, the rank of the update B A (> 0).
    lora_alpha: the update is scaled by lora_alpha / lora_rank.
    lora_dropout: dropout on the adapter's input during training (0 = none).
    target_modules: regex matched (``re.fullmatch``) against module names in msllm/HF naming
        (``model.layers.0.self_attn.q_proj``) or MindFormers naming (``model.layers.0.attention.wq``),
        or against the last name component alone (``q_proj|v_proj``), as PEFT matches.
    lora_a_init / lora_b_init: initialisers of A (r, in) and B (out, r); PEFT's defaults:
        A Kaiming-uniform (a = sqrt(5)), B zeros, so the adapted model starts equal to the base.

    The meaning of each key in detail, and what is refused: this module's docstring.
    """

    pet_type: str = "lora"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: str = ".*wq|.*wk|.*wv|.*wo"
    lora_a_init: str = "kaiming_uniform"
    lora_b_init: str = "zeros"


def pet_config_from(value, where: str = WHERE) -> Optional[PetConfig]:
    """A :class:`PetConfig` from a mapping of its keys (a manifest's ``"pet_config"``), a
    :class:`PetConfig` (returned as is) or None (full fine-tuning).

    Raises MsllmError naming ``where`` for an unknown key or a value that is not a mapping."""
    if value is None or isinstance(value, PetConfig):
        return value
    if not isinstance(value, dict):
        raise MsllmError(f"{where}: expected a mapping of LoRA keys (lora_rank, lora_alpha, ...), got {value!r}")
    names = {f.name for f in dataclasses.fields(PetConfig)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise MsllmError(f"{where}.{unknown[0]}: unknown key; {where} has {', '.join(sorted(names))}")
    return PetConfig(**value)


def lora_scale(pet_config) -> float:
    """``lora_alpha / lora_rank``: the factor of the update ``B A``."""
    return float(pet_config.lora_alpha) / float(pet_config.lora_rank)


def validate_pet_config(pet_config, where: str = WHERE) -> None:
    """Check a :class:`PetConfig`; None (full fine-tuning) passes. Messages name ``where.key``.

    Raises:
        MsllmError: one message naming the key and what was expected: an unknown ``pet_type``
            (listing :data:`PET_TYPES`), ``lora_rank`` <= 0, ``lora_alpha`` <= 0, ``lora_dropout``
            outside [0, 1), an empty or invalid ``target_modules`` regex, an unknown initialiser.
    """
    if pet_config is None:
        return
    pc = pet_config
    if pc.pet_type not in PET_TYPES:
        raise MsllmError(f"{where}.pet_type={pc.pet_type!r} is not available in msllm; it has: "
                         f"{', '.join(PET_TYPES)}")
    if isinstance(pc.lora_rank, bool) or not isinstance(pc.lora_rank, int) or pc.lora_rank <= 0:
        raise MsllmError(f"{where}.lora_rank={pc.lora_rank!r}: expected an integer > 0")
    if not float(pc.lora_alpha) > 0:
        raise MsllmError(f"{where}.lora_alpha={pc.lora_alpha!r}: expected a number > 0")
    if not 0.0 <= float(pc.lora_dropout) < 1.0:
        raise MsllmError(f"{where}.lora_dropout={pc.lora_dropout!r}: expected 0 <= lora_dropout < 1")
    if not isinstance(pc.target_modules, str) or not pc.target_modules.strip():
        raise MsllmError(f"{where}.target_modules={pc.target_modules!r}: expected a regex such as "
                         "'.*wq|.*wk|.*wv|.*wo' or '.*q_proj|.*v_proj'")
    try:
        re.compile(pc.target_modules)
    except re.error as exc:
        raise MsllmError(f"{where}.target_modules={pc.target_modules!r} is not a valid regex: {exc}") from None
    if pc.lora_a_init not in A_INITS:
        raise MsllmError(f"{where}.lora_a_init={pc.lora_a_init!r}: expected one of {', '.join(A_INITS)}")
    if pc.lora_b_init not in B_INITS:
        raise MsllmError(f"{where}.lora_b_init={pc.lora_b_init!r}: expected zeros (B = 0 makes the adapted "
                         "model start equal to the base model, as PEFT and MindFormers do)")


__all__ = ["PET_TYPES", "A_INITS", "B_INITS", "WHERE", "MINDFORMERS_WHERE", "PetConfig", "pet_config_from",
           "lora_scale", "validate_pet_config"]
