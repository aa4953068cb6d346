"""LoRA (Hu et al. 2021) for msllm's LLaMA, native in MindSpore, checked against Hugging Face PEFT.

* :mod:`msllm.config_lora`: the run config's ``pet_config`` section (:class:`~msllm.config_lora.PetConfig`),
  its semantics and validation (pure Python).
* :mod:`msllm.lora.targets`: which linear modules a ``target_modules`` regex selects (msllm/HF or
  MindFormers names), adapter parameter names and shapes (pure Python).
* :mod:`msllm.lora.layer`: the :class:`~msllm.lora.layer.LoRALinear` cell and A's initialisers.
* :mod:`msllm.lora.apply`: :func:`~msllm.lora.apply.apply_lora` on a built model (base frozen).
* :mod:`msllm.convert.starting`: the base model's identity (path + SHA-256), reading and loading it.
* :mod:`msllm.lora.adapter`: adapter checkpoints (adapters + optimizer state, base identity in
  the manifest), loading an adapter for inference or resume.
* :mod:`msllm.lora.merge`: ``W' = W + (alpha / r) B A`` into a new checkpoint.
* :mod:`msllm.lora.peft`: export to / import from PEFT adapter directories.
* :mod:`msllm.lora.layout`: parallel layouts of the adapters (Megatron pattern).

The user guide is ``docs/lora.md``.
"""
