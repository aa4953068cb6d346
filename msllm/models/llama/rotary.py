"""Rotary position embedding tables (Su et al. 2021, "RoFormer") with the rotary scalings the
LLaMA family uses: none, ``linear``, ``llama3`` (Llama 3.1+) and ``yarn`` (Qwen2.5 / Qwen3).
numpy only: the model (:mod:`msllm.models.llama.model`) computes cos/sin of the positions in use in its graph."""

from __future__ import annotations

import math

import numpy as np

from msllm.models.llama.config import LlamaConfig


def rotary_frequencies(config: LlamaConfig) -> tuple[np.ndarray, float]:
    """(inv_freq (D/2,) float32, attention factor): the angle of position p in pair i is
    ``p * inv_freq[i]``, and cos/sin are multiplied by the factor (1 but for YaRN). The model
    (:meth:`msllm.models.llama.model.LlamaModel.rotary`) turns positions into cos/sin with them
    in the graph, in float32 as transformers does: no table of ``max_position_embeddings`` rows.

    ``inv_freq[i] = theta^(-2i/D)`` (Su et al. 2021, RoFormer eq. 15). ``rope_scaling``:
    ``linear`` divides the frequencies by ``factor`` (HF ``_compute_linear_scaling_rope_parameters``);
    ``llama3`` (Llama 3.1+) divides the frequencies whose wavelength ``2 pi / inv_freq`` exceeds
    ``original_max_position_embeddings / low_freq_factor`` by ``factor``, keeps those below
    ``original / high_freq_factor``, and blends linearly in between (Meta's
    ``apply_scaling`` in llama-models ``reference_impl/model.py``; HF ``_compute_llama3_parameters``).
    ``yarn`` (Peng et al. 2023, "YaRN", sec. 3.2-3.4; Qwen2.5 / Qwen3 long context): frequencies
    blended between ``inv_freq / factor`` and ``inv_freq`` by a linear ramp over the dimensions
    whose rotations over ``original_max_position_embeddings`` lie between ``beta_slow`` and
    ``beta_fast``, and cos/sin multiplied by the attention factor ``0.1 ln(factor) + 1`` (or from
    ``mscale`` / ``mscale_all_dim`` / ``attention_factor``), as transformers 5.24's
    ``_compute_yarn_parameters`` (its formula changed across versions: ``truncate``, the mscale pair).
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))   # (D/2,)
    spec = config.rope_scaling or {}
    kind = spec.get("rope_type", spec.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(spec["factor"])
    elif kind == "llama3":
        factor, low, high = float(spec["factor"]), float(spec["low_freq_factor"]), float(spec["high_freq_factor"])
        old = float(spec["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv_freq = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    attention_factor = 1.0
    if kind == "yarn":
        inv_freq, attention_factor = _yarn(spec, d, config.rope_theta)
    return inv_freq.astype(np.float32), float(attention_factor)


def rotary_cos_sin(positions, inv_freq: np.ndarray, attention_factor: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, each (..., D) float32, of integer ``positions`` (...) for ``inv_freq`` (D/2,) float32 and
    the attention factor of :func:`rotary_frequencies`, bit for bit as the model's graph computes them
    (:meth:`msllm.models.llama.model.LlamaModel.rotary`): angles ``float32(position) * inv_freq`` in float32,
    duplicated along the last axis (HF "rotate_half" layout, as HF ``LlamaRotaryEmbedding``); their cosine
    and sine correctly rounded to float32, which is what MindSpore 2.10's CPU ``Cos`` / ``Sin`` return (float64,
    then rounded; numpy's float32 ``cos`` differs in the last bit for ~15% of angles); then times the factor
    in float32 when it is not 1."""
    angles = np.asarray(positions).astype(np.float32)[..., None] * inv_freq     # (..., D/2) float32
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)       # (..., D)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    if attention_factor != 1.0:
        cos, sin = cos * np.float32(attention_factor), sin * np.float32(attention_factor)
    return cos, sin


def rotary_tables(config: LlamaConfig, positions=None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, each (N, D) float32, of ``positions`` (N,) (default: every position up to
    ``max_positions``) for ``config`` (:func:`rotary_cos_sin` of :func:`rotary_frequencies`): numpy,
    as the model's graph computes them; the reference tests compare with transformers."""
    inv_freq, attention_factor = rotary_frequencies(config)
    pos = np.arange(config.max_positions) if positions is None else np.asarray(positions)
    return rotary_cos_sin(pos, inv_freq, attention_factor)


def _yarn(spec: dict, d: int, theta: float) -> tuple[np.ndarray, float]:
    """YaRN's (inv_freq (D/2,), attention factor); see :func:`rotary_tables`. Computed in float32
    like transformers (its ramp and frequencies are float32 tensors)."""
    factor, old = float(spec["factor"]), float(spec["original_max_position_embeddings"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attention = spec.get("attention_factor")
    if attention is None:
        m, m_all = spec.get("mscale"), spec.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = spec.get("beta_fast") or 32.0, spec.get("beta_slow") or 1.0

    def dim_at(rotations):  # the dimension index that turns ``rotations`` times over ``old`` positions
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_at(fast), dim_at(slow)
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    pos_freqs = (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))).astype(np.float32)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp                                                # 1 = extrapolate (keep the frequency)
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq.astype(np.float64), float(attention)


__all__ = ["rotary_frequencies", "rotary_cos_sin", "rotary_tables"]
