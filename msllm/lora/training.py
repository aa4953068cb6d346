"""What the trainer calls for a LoRA fine-tune (the run config's ``pet_config`` set; MindFormers'
``model.model_config.pet_config`` is moved there when the YAML is read): three calls,
so the trainer itself stays free of LoRA details.

    lora = LoraTraining(network, cfg, rank)            # right after building the network (before
                                                       # apply_layout / apply_recompute and the optimizer)
    lora.shard(cfg.parallel_config)                    # semi-auto parallel only, after apply_layout
    path = lora.save(step_cell, path, epoch, step, fmt, model_config)   # instead of save_checkpoint
    lora.resume(step_cell, path)                       # instead of load_into(step_cell, ...)

and resume looks for checkpoints in ``{output_dir}/checkpoint`` (:meth:`LoraTraining.resume_source`),
since ``load_checkpoint`` names the base model.
"""

from __future__ import annotations

import logging
import os

from msllm.errors import MsllmError

log = logging.getLogger("msllm")


class LoraTraining:
    """LoRA set-up of one training process.

    ``__init__(network, cfg, rank)``: validates ``cfg.pet_config``;
    requires ``load_checkpoint`` (the base: msllm / MindFormers checkpoint or HF directory) and
    refuses ``auto_trans_ckpt`` (the base is loaded whole; resharding a base for LoRA is not wired);
    loads the base into ``network`` and records its identity (path + SHA-256); applies LoRA
    (adapters seeded by ``cfg.seed``, identical on every rank). Logs trainable vs total
    parameters. Call it before ``apply_layout`` / ``apply_recompute``: they then find the base
    weights and ``matmul`` primitives inside the LoRA cells, and recompute covers the LoRA cells. Attributes: ``info`` (:class:`~msllm.lora.apply.LoraInfo`), ``base`` (identity),
    ``record`` (the manifest's ``"lora"`` value).
    """

    def __init__(self, network, cfg, rank: int = 0):
        from msllm.lora.adapter import lora_record
        from msllm.lora.apply import apply_lora
        from msllm.convert.starting import load_base_into
        from msllm.config_lora import validate_pet_config

        pet = cfg.pet_config
        validate_pet_config(pet)
        if not cfg.load_checkpoint:
            raise MsllmError("pet_config (LoRA) needs load_checkpoint: the base model to adapt "
                             "(an msllm or MindFormers checkpoint, or a Hugging Face directory)")
        if cfg.auto_trans_ckpt:
            raise MsllmError("auto_trans_ckpt with pet_config (LoRA) is not supported: the base "
                             "is loaded whole on every rank; set auto_trans_ckpt: False")
        self.rank = rank
        self.network = network
        self.base = load_base_into(network, cfg.load_checkpoint, rank)
        log.info("LoRA base model %s (SHA-256 %s)", self.base["path"], self.base["sha256"])
        self.info = apply_lora(network, pet, seed=cfg.seed)
        self.record = lora_record(pet, self.info.modules, self.base)
        log.info(self.info.log_line())
        if pet.lora_dropout > 0:
            log.info("lora_dropout %g: MindSpore's Dropout operator keeps its random state inside the kernel, "
                     "so after a resume the dropout masks differ from the uninterrupted run's (resume is "
                     "bit-exact with lora_dropout 0)", pet.lora_dropout)

    def shard(self, parallel_config) -> None:
        """Semi-auto parallel (after ``apply_layout``): shard the LoRA primitives like their base
        layers (:func:`msllm.lora.layout.apply_lora_layout`)."""
        from msllm.lora.layout import apply_lora_layout

        apply_lora_layout(self.network, parallel_config)

    @staticmethod
    def resume_source(output_dir: str) -> str:
        """Where resume looks for this run's (adapter) checkpoints: ``{output_dir}/checkpoint``."""
        return os.path.join(output_dir, "checkpoint")

    def save(self, cell, path: str, epoch: int, step: int, fmt: str = "ckpt", model_config=None, **extra) -> str:
        """Adapter checkpoint of train step ``cell`` (adapters, AdamW moments, counters; no base
        weight) with the base identity in its manifest (:func:`~msllm.lora.adapter.save_adapter_checkpoint`)."""
        from msllm.lora.adapter import save_adapter_checkpoint

        return save_adapter_checkpoint(cell, self.network, path, self.record, epoch, step, fmt, model_config,
                                       **extra)

    def resume(self, cell, path: str) -> dict:
        """Load adapter checkpoint ``path`` into train step ``cell``; MsllmError if it was trained on
        another base (SHA-256) or lacks an entry. Returns its manifest."""
        from msllm.lora.adapter import load_adapter_state

        return load_adapter_state(cell, self.network, path, self.base["path"], self.rank)


__all__ = ["LoraTraining"]
