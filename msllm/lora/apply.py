"""Put LoRA into a built :class:`~msllm.models.llama.model.LlamaForCausalLM` from outside, the way
a parallel layout is applied (torchtitan style: the model file knows nothing of LoRA).

:func:`apply_lora` freezes every base parameter (``requires_grad = False``: no gradient is
computed for it and ``network.trainable_params()``, from which the trainer builds AdamW, holds
only the adapters, so the base gets no optimizer state) and replaces each targeted ``Linear``
with a :class:`~msllm.lora.layer.LoRALinear` that reuses the base weight Parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from msllm.errors import MsllmError
from msllm.config_lora import lora_scale, validate_pet_config
from msllm.lora.layer import LoRALinear, init_a
from msllm.lora.targets import describe_modules, is_adapter_param, match_targets


@dataclass
class LoraInfo:
    """What :func:`apply_lora` did.

    modules: adapted modules (msllm names); rank / alpha / dropout / scale: the update's settings;
    trainable: adapter parameter count (elements); total: all parameters of the network
    (base + adapters); adapter_params: names of the adapter parameters.
    """

    modules: list
    rank: int
    alpha: float
    dropout: float
    scale: float
    trainable: int
    total: int
    adapter_params: list = field(default_factory=list)

    def log_line(self) -> str:
        """``LoRA: 0.30M trainable of 9.23M parameters (3.25%); rank 8, alpha 16, ...``."""
        return (f"LoRA: {_count(self.trainable)} trainable of {_count(self.total)} parameters "
                f"({100.0 * self.trainable / max(self.total, 1):.2f}%); rank {self.rank}, alpha {self.alpha:g} "
                f"(scale {self.scale:g}), dropout {self.dropout:g}; base frozen (no gradients, no optimizer "
                f"states); {len(self.modules)} module(s): {describe_modules(self.modules)}")


def _count(n: int) -> str:
    """``1234567`` -> ``1.23M``; ``4096`` -> ``4.10K``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def resolve_cell(network, path: str):
    """The sub-cell at dotted ``path`` (``model.layers.3.self_attn.q_proj``) and its parent and
    attribute name: ``(parent, attr, cell)``."""
    parent, cell = None, network
    attr = ""
    for part in path.split("."):
        parent, attr = cell, part
        cell = cell[int(part)] if part.isdigit() else getattr(cell, part)
    return parent, attr, cell


def apply_lora(network, pet_config, seed: int = 0, modules=None, dropout=None) -> LoraInfo:
    """Add LoRA to ``network`` (a ``LlamaForCausalLM``) per ``pet_config``, in place.

    Args:
        network: the model, built, base weights loaded or not (loading before or after works:
            the base weight Parameters keep their names ``<module>.weight``).
        pet_config: a :class:`~msllm.config_lora.PetConfig`, the run config's ``pet_config``
            section or an adapter manifest's (validated here).
        seed: seed of A's initialisation (with each parameter's name, :func:`~msllm.lora.layer.init_a`);
            the same on every rank. Pass the run's ``seed``.
        modules: adapt exactly these modules (msllm names) instead of matching ``target_modules``
            (used when loading an adapter, whose manifest lists them).
        dropout: override ``pet_config.lora_dropout`` (0 for inference).

    Every parameter of the network is frozen; the adapters are named ``<module>.lora_A.weight``
    (r, in) and ``<module>.lora_B.weight`` (out, r), float32; B starts at zero, so the logits
    equal the base model's exactly until the first update.

    Returns a :class:`LoraInfo`, also recorded on the network as ``network.lora_info`` (read by
    :func:`msllm.lora.layout.apply_lora_layout`: the model config carries no LoRA settings).
    Raises MsllmError for an invalid ``pet_config``, a regex that
    matches nothing (listing the modules there are), or a network that already has LoRA or whose layers read weights
    stacked for the decode step (:mod:`msllm.models.llama.stacked`).
    """
    import numpy as np

    validate_pet_config(pet_config)
    if modules is None:
        modules = match_targets(network.config, pet_config.target_modules)
    if any(is_adapter_param(p.name) for p in network.get_parameters()):
        raise MsllmError("the network already has LoRA adapters; apply_lora must be called once")
    for p in network.get_parameters():
        p.requires_grad = False
    rank, alpha = pet_config.lora_rank, float(pet_config.lora_alpha)
    drop = float(pet_config.lora_dropout if dropout is None else dropout)
    for module in modules:
        parent, attr, base = resolve_cell(network, module)
        if not hasattr(base, "weight") or not hasattr(base, "matmul"):
            raise MsllmError(f"LoRA target {module} is not a linear layer")
        if getattr(base, "layer_index", None) is not None:
            raise MsllmError(f"LoRA target {module} reads a slice of weights stacked over the decoder layers for "
                             "msllm's decode step (msllm/models/llama/stacked.py): apply the adapter when loading "
                             "(load_for_inference(adapter=...), --adapter), or load with MSLLM_STACK_WEIGHTS=0")
        out_f, in_f = base.weight.shape
        a = init_a((rank, in_f), pet_config.lora_a_init, seed, f"{module}.lora_A.weight")
        cell = LoRALinear(base, rank, alpha, drop, a, np.zeros((out_f, rank), np.float32))
        setattr(parent, attr, cell)
        # MindSpore prefixes names with the attribute name only when a cell is set after
        # construction; restore the full names (the base weight keeps ``<module>.weight``).
        for local, p in cell.parameters_and_names():
            p.name = f"{module}.{local}"
    adapters = adapter_param_names(network)
    params = list(network.get_parameters())
    info = LoraInfo(list(modules), rank, alpha, drop, lora_scale(pet_config),
                    sum(p.size for p in params if p.name in set(adapters)), sum(p.size for p in params), adapters)
    network.lora_info = info
    return info


def adapter_param_names(network) -> list[str]:
    """Names of the LoRA parameters of ``network`` (``<module>.lora_A.weight`` / ``.lora_B.weight``),
    in network order."""
    return [p.name for p in network.get_parameters() if is_adapter_param(p.name)]


def frozen_param_names(network) -> list[str]:
    """Names of the base parameters LoRA froze (everything of ``network`` but the adapters)."""
    return [p.name for p in network.get_parameters() if not is_adapter_param(p.name)]


def has_lora(network) -> bool:
    """True if :func:`apply_lora` was applied to ``network``."""
    return any(is_adapter_param(p.name) for p in network.get_parameters())


__all__ = ["LoraInfo", "apply_lora", "adapter_param_names", "frozen_param_names", "has_lora", "resolve_cell"]
