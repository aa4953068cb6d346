"""Meaning and validation of ``model.model_config.pet_config`` (the dataclass is
:class:`msllm.models.llama.config.PetConfig`; its keys are MindFormers', ``lora_llama2_7b.yaml``).

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

import re

from msllm.errors import MsllmError

PET_TYPES = ("lora",)
A_INITS = ("kaiming_uniform", "gaussian", "normal")
B_INITS = ("zeros", "zero")
WHERE = "model.model_config.pet_config"


def lora_scale(pet_config) -> float:
    """``lora_alpha / lora_rank``: the factor of the update ``B A``."""
    return float(pet_config.lora_alpha) / float(pet_config.lora_rank)


def validate_pet_config(pet_config, where: str = WHERE) -> None:
    """Check a :class:`~msllm.models.llama.config.PetConfig`; None (full fine-tuning) passes.

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


__all__ = ["PET_TYPES", "A_INITS", "B_INITS", "lora_scale", "validate_pet_config"]
