"""Weight-only int8 inference: ``model.model_config.quantization_config`` (or the shorthand
``param_init_type: int8``), round-to-nearest symmetric quantization of the linear layers' weights at
load time, run by msllm's CPU kernel ``linear_int8`` (``msllm/kernels/csrc/linear_int8.cc``: int8
widened to float32 in registers, float32 arithmetic).

Names follow MindFormers' ``quantization_config`` (``mindformers/utils/quantization_config.py``,
classes ``RtnConfig`` / ``PtqConfig``, which MindFormers hands to MindSpore Golden-Stick's PTQ):
``quant_method: rtn`` (Golden-Stick's ``RoundToNearest``, weight-only "A16W8"), ``weight_dtype: int8``,
``activation_dtype`` / ``kvcache_dtype`` (only None: weights only), ``weight_quant_granularity``
(``per_channel`` or ``per_group``, PtqConfig's key) with ``group_size`` (inputs per scale; PtqConfig
accepts 64 or 128, msllm any multiple of 16), ``modules_to_not_convert`` (module names kept in the
unquantized dtype, matched as MindFormers' ``opname_blacklist``: a name containing the entry).

The rule (RTN, symmetric, no zero point): for each output row o and group g of inputs,
``s[o, g] = max_i |W[o, i]| / 127`` over the group, ``q = round(W / s)`` (half to even, numpy's
``rint``) in [-127, 127]; the layer computes ``x (q * s)^T``. A group of zeros gets s = 0, q = 0.
Every weight's error is at most s / 2 = max|W| / 254 of its row or group.

Which parameters: every linear layer of the decoder (q/k/v/o projections, gate/up/down) and the
output head, each with its own scales. The head is quantized because decoding reads it every token
(SmolLM2-135M: 28.3M of 134.5M parameters, a fifth of the bytes per token); a tied head gets an int8
copy of the table for the head alone. The embedding table, the norms and the biases stay in
``param_init_type`` (``embedding_init_type``): a lookup reads one row per token, so int8 would save
memory but no time. ``modules_to_not_convert: [lm_head]`` keeps the head in the float dtype.
Inference only: training refuses it (``msllm.cluster.context.check_device_support``). The loaded
model is converted by :func:`msllm.models.llama.int8_model.quantize_model` (apart from this module,
which the config imports: the model imports the config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from msllm.errors import MsllmError

QUANT_METHODS = ("rtn",)
GRANULARITIES = ("per_channel", "per_group")
_NONE = (None, "none", "None", "")


@dataclass
class QuantizationConfig:
    """``model.model_config.quantization_config`` (MindFormers' keys; see the module docstring).

    quant_method: ``rtn`` (round to nearest, symmetric, per output channel or group); required, as in
        MindFormers' RtnConfig: None (an empty section, MindFormers' "no quantization") with any
        other key set is refused, and alone means no quantization (:meth:`is_off`).
    weight_dtype: ``int8``.
    activation_dtype / kvcache_dtype: None (``none``): activations and the KV cache stay float32.
    weight_quant_granularity: ``per_channel`` (one scale per output row) or ``per_group`` (one per
        output row and ``group_size`` consecutive inputs; the last group may be shorter).
    group_size: inputs per scale with ``per_group`` (a multiple of 16, the kernel's vector width);
        0 with ``per_channel``.
    modules_to_not_convert: module names (``lm_head``, ``down_proj``, ``model.layers.0.mlp``...)
        whose linear layers stay in the float dtype; an entry matches a module whose name contains it.
    """

    quant_method: Optional[str] = None
    weight_dtype: str = "int8"
    activation_dtype: Optional[str] = None
    kvcache_dtype: Optional[str] = None
    weight_quant_granularity: str = "per_channel"
    group_size: int = 0
    modules_to_not_convert: list = field(default_factory=list)

    def is_off(self) -> bool:
        """True for a section without ``quant_method`` (MindFormers' empty ``quantization_config``)."""
        return self.quant_method in _NONE

    def validate(self, where: str = "model.model_config.quantization_config") -> None:
        """Raise :class:`MsllmError` naming the key for a value msllm cannot run."""
        if self.is_off():
            if self != QuantizationConfig():
                raise MsllmError(f"{where}: set quant_method (rtn: round-to-nearest weight-only int8) or remove the "
                                 "section; without it nothing is quantized")
            return
        if self.quant_method not in QUANT_METHODS:
            raise MsllmError(f"{where}.quant_method={self.quant_method!r}: msllm runs {QUANT_METHODS} (round to "
                             "nearest, weight-only int8: Golden-Stick's A16W8); calibrated methods (ptq, "
                             "smooth_quant, gptq, awq) need Golden-Stick on Ascend")
        if str(self.weight_dtype) != "int8":
            raise MsllmError(f"{where}.weight_dtype={self.weight_dtype!r}: expected int8")
        for key, value in (("activation_dtype", self.activation_dtype), ("kvcache_dtype", self.kvcache_dtype)):
            if value not in _NONE:
                raise MsllmError(f"{where}.{key}={value!r}: msllm quantizes weights only (A16W8); set it to none")
        if self.weight_quant_granularity not in GRANULARITIES:
            raise MsllmError(f"{where}.weight_quant_granularity={self.weight_quant_granularity!r}: expected one of "
                             f"{GRANULARITIES}")
        per_group = self.weight_quant_granularity == "per_group"
        if per_group and (not isinstance(self.group_size, int) or self.group_size <= 0 or self.group_size % 16):
            raise MsllmError(f"{where}.group_size={self.group_size!r}: per_group needs a positive multiple of 16 "
                             "(Golden-Stick uses 64 or 128)")
        if not per_group and self.group_size not in (0, None):
            raise MsllmError(f"{where}.group_size={self.group_size!r} with weight_quant_granularity per_channel: "
                             "set group_size 0, or weight_quant_granularity per_group")
        if not isinstance(self.modules_to_not_convert, list) or not all(
                isinstance(m, str) and m for m in self.modules_to_not_convert):
            raise MsllmError(f"{where}.modules_to_not_convert={self.modules_to_not_convert!r}: expected a list of "
                             "module names")

    @property
    def group(self) -> int:
        """Inputs per scale: ``group_size`` with per_group, 0 (= the whole row) with per_channel."""
        return self.group_size if self.weight_quant_granularity == "per_group" else 0

    def converts(self, module: str) -> bool:
        """True when the linear layer ``module`` (``model.layers.0.self_attn.q_proj``) is quantized."""
        return not any(entry in module for entry in self.modules_to_not_convert)

    def describe(self) -> str:
        how = "per output channel" if not self.group else f"per group of {self.group} inputs"
        kept = f"; kept in float: {self.modules_to_not_convert}" if self.modules_to_not_convert else ""
        return f"weight-only int8 ({self.quant_method}, symmetric, {how}{kept})"


def quantize_rows(w: np.ndarray, group: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Round-to-nearest symmetric int8 of a weight matrix (the rule in the module docstring).

    Args:
        w: (out, in) float array (float32, float64 or bfloat16 widened: any real dtype).
        group: inputs per scale; 0 = per output channel (one group of ``in``).
    Returns:
        ``(q, scale, group)``: q (out, in) int8 in [-127, 127], scale (out, G) float32 with
        G = ceil(in / group), and the group size used (``in`` for per channel).
    Raises:
        MsllmError: w is not 2-D, or holds a NaN or an infinity.
    """
    w = np.asarray(w)
    if w.ndim != 2:
        raise MsllmError(f"int8 quantization: expected a (out, in) weight matrix, got shape {w.shape}")
    out, n = w.shape
    g = n if not group else int(group)
    groups = max(1, -(-n // g))
    wf = w.astype(np.float64)
    if not np.isfinite(wf).all():
        raise MsllmError("int8 quantization: the weight matrix holds NaN or infinity")
    padded = np.zeros((out, groups * g), np.float64)
    padded[:, :n] = wf
    blocks = padded.reshape(out, groups, g)
    amax = np.abs(blocks).max(-1)                                             # (out, G)
    scale = (amax / 127.0).astype(np.float32)
    safe = np.where(scale > 0, scale.astype(np.float64), 1.0)[..., None]
    q = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8).reshape(out, groups * g)[:, :n]
    return np.ascontiguousarray(q), scale, g


def dequantize(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """``q * s`` as float64 (out, in): the matrix the int8 layer multiplies by (the tests' reference)."""
    out, n = q.shape
    s = np.repeat(scale.astype(np.float64), group, axis=1)[:, :n]
    return q.astype(np.float64) * s


__all__ = ["QuantizationConfig", "QUANT_METHODS", "GRANULARITIES", "quantize_rows", "dequantize"]
