"""Which implementation each part of the model uses, from the model config and the device.

Three ``model.model_config`` keys (fields of :class:`msllm.models.llama.config.LlamaConfig`)
choose:

``use_flash_attention`` (MindFormers' key)
    Attention without the (B, H, T, T) score tensor. On the CPU fast path: msllm's kernel
    (``msllm/kernels/csrc/attention.cc``). On the layout path (Ascend): MindSpore's
    ``FlashAttentionScore`` (float16/bfloat16 only, so it needs ``compute_dtype`` float16 or
    bfloat16). None: on wherever it exists (CPU: when the kernels are built; Ascend: when the
    compute dtype allows); True: required, refused where it cannot run; False: composed operators.
``fused_rms_norm`` (MindFormers' key, MindFormers' default True)
    RMSNorm as one operator: msllm's kernel on the CPU fast path (fused with the residual add
    before the MLP), MindSpore's ``ops.RmsNorm`` on the layout path (Ascend only). None / True /
    False as above.
``cpu_kernels`` (msllm's key)
    msllm's CPU kernels for the linear layers (oneDNN sgemm), SwiGLU and the rotary embedding, and
    the precondition of the two CPU choices above. None: use them when built; True: required
    (refused when not built, with the build command); False: MindSpore's operators only. No effect
    on the layout path.

``compute_dtype`` on the CPU fast path: ``float32``, or ``bfloat16`` (MindFormers' training
setting), which the CPU kernels take as the precision of the linear layers' GEMMs (forward and
both gradients, the output head included): each GEMM rounds its inputs to bfloat16 and sums in
float32 (``csrc/gemm_bf16.cc``: oneDNN's bf16 arithmetic where the CPU has it, AMX-BF16 or
AVX512_BF16, else emulated with the same results up to summation order). The activations, norms,
attention, softmax, loss and LoRA's rank-r adapter products stay float32 (``layernorm_compute_type`` / ``softmax_compute_type``
must be float32), parameters float32 for training. For inference (predict, chat, serve, evaluate) it
may be combined with ``param_init_type: bfloat16``: the GEMMs then take the stored bfloat16 weights
as they are (no rounded copy; ``gemm_bf16_weights``) and only the activations are rounded, the
arithmetic of llama.cpp's bf16 models and about twice the float32 GEMMs' speed on AVX512_BF16 (a
512-token prefill of SmolLM2's layers: 10.2 ms per layer against 20.2 on AMD Zen 4). A decode
step's fused decoder layers (``csrc/decode_fused.cc``, one token per row: memory-bound) keep
float32 activations either way. MindSpore 2.10 has no bf16 CPU operators, so without the kernels it
is refused.

The choice is logged once per model build (logger ``msllm``), naming what runs and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from msllm.errors import MsllmError

log = logging.getLogger("msllm")

COMPOSED = "composed"
CPU_FLASH = "msllm CPU flash attention"
ASCEND_FLASH = "MindSpore FlashAttentionScore"
CPU_NORM = "msllm CPU RMSNorm (+ residual add)"
ASCEND_NORM = "MindSpore RmsNorm"


@dataclass(frozen=True)
class KernelChoice:
    """What the model builds. ``cpu``: :class:`msllm.kernels.ops.CpuKernels` or None (MindSpore's
    operators for linear, SwiGLU, rotary); ``attention`` / ``norm``: one of the names above."""

    cpu: Optional[Any]
    attention: str
    norm: str
    notes: tuple = ()

    @property
    def bf16_gemms(self) -> bool:
        """The linear layers' GEMMs round their inputs to bfloat16 (``compute_dtype: bfloat16`` on
        the CPU kernels); every tensor between them is float32."""
        return self.cpu is not None and self.cpu.gemm_dtype == "bfloat16"

    def describe(self) -> str:
        if self.cpu is not None:
            from msllm.kernels import gemm_bf16_native, gemm_path, vector_isa

            linear = f"msllm CPU kernels ({gemm_path()}; vector code {vector_isa()})"
            if self.bf16_gemms:
                how = ("this CPU's bf16 arithmetic via oneDNN" if gemm_bf16_native() else
                       "emulated: this CPU has no bf16 arithmetic, slower than float32")
                linear += (f", compute_dtype bfloat16: GEMM inputs rounded to bfloat16, float32 sums ({how}); "
                           "activations, norms, attention, softmax and loss float32; a decode step's fused "
                           "layers keep float32 GEMM inputs")
        else:
            linear = "MindSpore MatMul"
        text = f"model kernels: linear/SwiGLU/rotary: {linear}; attention: {self.attention}; RMSNorm: {self.norm}"
        return text + ("" if not self.notes else " (" + "; ".join(self.notes) + ")")


def _setting(key: str, value) -> Optional[bool]:
    if value is not None and not isinstance(value, bool):
        raise MsllmError(f"model.model_config.{key}={value!r}: expected true, false or null")
    return value


def check_bf16_compute(config, inference: bool = False) -> None:
    """Raise one :class:`MsllmError` unless ``config`` (a LlamaConfig with ``compute_dtype: bfloat16`` on
    the CPU fast path) is what the kernels' bf16-input GEMMs serve (module docstring): ``cpu_kernels``
    not False, ``layernorm_compute_type`` and ``softmax_compute_type`` float32, float32 parameters
    (``inference``: float32 or bfloat16). Whether the kernels are built is :func:`choose`'s check;
    ``check_device_support`` calls this before a run reads its data (training: float32 parameters)."""
    if getattr(config, "cpu_kernels", None) is False:
        raise MsllmError("model.model_config.compute_dtype: bfloat16 on CPU runs on msllm's CPU kernels "
                         "(MindSpore 2.10 has no bf16 CPU operators), but cpu_kernels is False")
    norm_t = getattr(config, "layernorm_compute_type", "float32")
    soft_t = getattr(config, "softmax_compute_type", "float32")
    stored = {getattr(config, k, None) or "float32" for k in ("param_init_type", "embedding_init_type")}
    allowed = {"float32", "bfloat16"} if inference else {"float32"}
    if norm_t != "float32" or soft_t != "float32" or not stored <= allowed:
        raise MsllmError(
            "model.model_config.compute_dtype: bfloat16 on CPU rounds the GEMMs' inputs to bfloat16 and keeps "
            "everything else float32: it needs layernorm_compute_type and softmax_compute_type float32 and "
            + ("float32 or bfloat16 parameters" if inference else
               "float32 parameters for training (param_init_type bfloat16 serves inference)")
            + f" (the config has layernorm_compute_type {norm_t!r}, softmax_compute_type "
            f"{soft_t!r}, parameters {sorted(stored)})")


def choose(config, fast_paths: bool, device: str = "CPU") -> KernelChoice:
    """Resolve the three keys for ``config`` (a :class:`~msllm.models.llama.config.LlamaConfig`).

    Args:
        fast_paths: the model's CPU fast path (``RunConfig.fast_paths``: CPU without operator
            sharding); False is the layout path the parallel strategies are written for.
        device: ``"CPU"`` / ``"Ascend"`` / ``"GPU"``: where the model runs (the builders pass
            ``RunConfig.context.device_target``; nothing here reads MindSpore's global context).
    Raises:
        MsllmError: a key set to True asks for something this device or build cannot do.
    """
    want_cpu = _setting("cpu_kernels", config.cpu_kernels)
    want_fa = _setting("use_flash_attention", config.use_flash_attention)
    want_norm = _setting("fused_rms_norm", config.fused_rms_norm)
    notes = []
    if fast_paths:
        from msllm import kernels

        cpu = None
        compute = getattr(config, "compute_dtype", "float32")
        if compute == "bfloat16":   # the kernels' bf16-input GEMMs, or nothing (module docstring)
            # bfloat16 weights pass here; training refuses them before building a model
            # (msllm.cluster.context.check_device_support)
            check_bf16_compute(config, inference=True)
            why = kernels.unavailable_reason()
            if why is not None:
                raise MsllmError(f"model.model_config.compute_dtype: bfloat16 on CPU runs on msllm's CPU kernels: {why}")
            cpu = kernels.cpu_kernels("bfloat16")
            if getattr(config, "moe_config", None) is not None:
                notes.append("compute_dtype bfloat16: the experts' grouped GEMMs stay float32")
        elif want_cpu is not False:
            why = kernels.unavailable_reason()
            dtypes = {compute, getattr(config, "layernorm_compute_type", "float32"),
                      getattr(config, "softmax_compute_type", "float32")}
            # parameters may be stored in bfloat16 for inference (the linear kernel reads bf16
            # weights and computes in float32)
            stored = {getattr(config, k, None) or "float32" for k in ("param_init_type", "embedding_init_type")}
            if why is None and (dtypes != {"float32"} or not stored <= {"float32", "bfloat16"}):
                why = (f"msllm's CPU kernels compute in float32 (or with bfloat16 GEMM inputs: compute_dtype "
                       f"bfloat16), with float32 or bfloat16 parameters (the config has compute {sorted(dtypes)}, "
                       f"parameters {sorted(stored)})")
            if why is None:
                cpu = kernels.cpu_kernels()
            else:
                asked = [k for k, v in (("cpu_kernels", want_cpu), ("use_flash_attention", want_fa),
                                        ("fused_rms_norm", want_norm)) if v]
                if asked:
                    raise MsllmError(f"model.model_config.{asked[0]}: True needs {why}")
                notes.append(why)
        for key, want in (("use_flash_attention", want_fa), ("fused_rms_norm", want_norm)):
            if want and cpu is None:  # only when cpu_kernels is False
                raise MsllmError(f"model.model_config.{key}: True on CPU needs msllm's CPU kernels, but "
                                 "cpu_kernels is False")
        attention = CPU_FLASH if cpu is not None and want_fa is not False else COMPOSED
        norm = CPU_NORM if cpu is not None and want_norm is not False else COMPOSED
        return KernelChoice(cpu, attention, norm, tuple(notes))

    # layout path (Ascend, or operator sharding): MindSpore's fused primitives where documented
    ascend = device == "Ascend"
    low_precision = getattr(config, "compute_dtype", "float32") in ("float16", "bfloat16")
    if want_fa and not low_precision:
        raise MsllmError(f"model.model_config.use_flash_attention: True needs compute_dtype float16 or bfloat16 "
                         f"(MindSpore's FlashAttentionScore takes no float32), got {config.compute_dtype!r}")
    head_dim_ok = getattr(config, "head_dim", 16) % 16 == 0  # FlashAttentionScore: "D ... a multiple of 16"
    if want_fa and not head_dim_ok:
        raise MsllmError(f"model.model_config.use_flash_attention: True needs head_dim (hidden_size / num_heads) "
                         f"a multiple of 16 (MindSpore's FlashAttentionScore), got {config.head_dim}")
    attention = ASCEND_FLASH if want_fa or (want_fa is None and ascend and low_precision and head_dim_ok) else COMPOSED
    norm = ASCEND_NORM if want_norm or (want_norm is None and ascend) else COMPOSED
    if not ascend and (attention != COMPOSED or norm != COMPOSED):
        notes.append(f"{attention if attention != COMPOSED else norm} runs on Ascend only: this graph cannot "
                     f"run on {device}")
    if want_cpu:
        notes.append("cpu_kernels has no effect on the layout path")
    return KernelChoice(None, attention, norm, tuple(notes))
