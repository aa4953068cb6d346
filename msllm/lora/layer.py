"""The LoRA cell: a frozen linear layer plus a trainable low-rank update (Hu et al. 2021,
"LoRA: Low-Rank Adaptation of Large Language Models", eq. 3).

``y = x W^T + s * (dropout(x) A^T) B^T`` with W (out, in) frozen, A (r, in), B (out, r) and
``s = lora_alpha / r``; the same computation as PEFT's ``peft.tuners.lora.layer.Linear.forward``
(``result + lora_B(lora_A(dropout(x))) * scaling``). Here ``s`` multiplies the (N, r) product
instead of the (N, out) one: the same value up to rounding (exactly the same when ``s`` is a power
of two), and r/out times fewer multiplies.

:class:`LoRALinear` takes over a :class:`msllm.models.llama.model.Linear` from outside (the model
file knows nothing of LoRA): it keeps the base cell's weight Parameter and its ``matmul``
primitive (so a parallel layout applied to it stays), and adds ``lora_A`` / ``lora_B``.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

# MindSpore's ``Normal()`` initializer default sigma, what MindFormers' ``lora_a_init: normal`` gives.
MINDSPORE_NORMAL_SIGMA = 0.01


def init_a(shape: tuple[int, int], kind: str, seed: int, name: str) -> np.ndarray:
    """Initial A (r, in) float32, reproducible from ``(seed, name)`` alone, so every data-parallel
    rank (and a rerun) builds the same adapter without communicating.

    ``kaiming_uniform``: U(-1/sqrt(in), 1/sqrt(in)), which is ``torch.nn.init.kaiming_uniform_(A,
    a=sqrt(5))`` (gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in)), PEFT's default;
    ``gaussian``: N(0, 1/r) (PEFT ``init_lora_weights="gaussian"``); ``normal``: N(0, 0.01)
    (MindFormers' default through MindSpore's ``Normal()``).
    """
    rng = np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(name.encode("utf-8"))])
    r, fan_in = shape
    if kind == "kaiming_uniform":
        bound = 1.0 / math.sqrt(fan_in)
        return rng.uniform(-bound, bound, size=shape).astype(np.float32)
    if kind == "gaussian":
        return (rng.standard_normal(shape) / r).astype(np.float32)
    if kind == "normal":
        return (rng.standard_normal(shape) * MINDSPORE_NORMAL_SIGMA).astype(np.float32)
    raise ValueError(f"unknown lora_a_init {kind!r}")  # validate_pet_config refuses it first


class LoRAMatrix(nn.Cell):
    """Holds one adapter matrix as ``weight`` (float32), so its name ends in ``.lora_A.weight`` /
    ``.lora_B.weight`` like PEFT's ``nn.Linear`` sub-modules."""

    def __init__(self, value: np.ndarray):
        super().__init__()
        self.weight = Parameter(Tensor(value, ms.float32), name="weight")


class LoRALinear(nn.Cell):
    """A :class:`~msllm.models.llama.model.Linear` with a LoRA update.

    Args:
        base: the Linear cell to adapt; its weight (out, in) and bias (out,), if it has one
            (Qwen2's q/k/v), are reused (same Parameters) and frozen (``requires_grad = False``),
            as PEFT's ``lora.Linear`` keeps the base layer's bias and trains only A and B.
        rank: r > 0.
        alpha: the update is scaled by ``alpha / rank``.
        dropout: probability of dropping an element of the adapter's input in training (0 = no
            dropout operator).
        a: initial A (r, in); b: initial B (out, r) (float32 arrays; B is zeros by default).

    Adapter parameters are float32 whatever the base dtype (PEFT's ``autocast_adapter_dtype``
    likewise keeps adapters in float32); they are cast to the compute dtype for the matmuls.

    ``construct(x, static_rows=False)``: x (N, in) -> (N, out) in ``compute_dtype``
    (``static_rows``: as :meth:`msllm.models.llama.model.Linear.construct`).
    """

    def __init__(self, base, rank: int, alpha: float, dropout: float, a: np.ndarray, b: np.ndarray):
        super().__init__()
        out_f, in_f = base.weight.shape
        if a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise ValueError(f"LoRA shapes A {a.shape}, B {b.shape} do not fit a ({out_f}, {in_f}) weight "
                             f"at rank {rank}")
        self.weight = base.weight
        self.weight.requires_grad = False
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad = False
        self.add_bias = base.add_bias
        self.matmul, self.matmul_static = base.matmul, base.matmul_static
        self.compute_dtype = base.compute_dtype
        self.cast = ops.Cast()
        self.lora_A = LoRAMatrix(a)
        self.lora_B = LoRAMatrix(b)
        self.lora_a_matmul = ops.MatMul(transpose_b=True)
        self.lora_b_matmul = ops.MatMul(transpose_b=True)
        self.mul_scale = ops.Mul()
        self.add_lora = ops.Add()
        self.rank, self.alpha = int(rank), float(alpha)
        # the adapter's update is not in the base weight: msllm's fused decode step (which reads
        # Linear weights directly) must not serve this layer (DecoderLayer.fused_decode_ok)
        self.fusable = False
        self.scale = float(alpha) / float(rank)
        self.use_dropout = dropout > 0
        self.lora_dropout = nn.Dropout(p=float(dropout)) if dropout > 0 else None

    def construct(self, x, static_rows=False):
        x = self.cast(x, self.compute_dtype)                                         # (N, in)
        matmul = self.matmul_static if static_rows else self.matmul
        out = matmul(x, self.cast(self.weight, self.compute_dtype))                  # (N, out)
        if self.bias is not None:   # the base layer's output, bias included, then the update (PEFT's order)
            out = self.add_bias(out, self.cast(self.bias, self.compute_dtype))
        h = self.lora_dropout(x) if self.use_dropout else x
        a = self.lora_a_matmul(h, self.cast(self.lora_A.weight, self.compute_dtype))  # (N, r)
        a = self.mul_scale(a, self.scale)
        return self.add_lora(out, self.lora_b_matmul(a, self.cast(self.lora_B.weight, self.compute_dtype)))  # (N, out)


__all__ = ["LoRALinear", "LoRAMatrix", "init_a", "MINDSPORE_NORMAL_SIGMA"]
