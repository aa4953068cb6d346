"""Throughput accounting: tokens/s/device (tgs), achieved TFLOPs, MFU and HFU, and the device peak.

MFU (model FLOPs utilisation, PaLM: Chowdhery et al. 2022, appendix B; Megatron reports the same)
= ``tgs * flops_per_token / peak_flops_per_device``, with ``flops_per_token = 6N + 12 L H D T``
(:meth:`msllm.models.llama.config.LlamaConfig.train_flops_per_token`): comparable across
implementations, it is not the work a step does. HFU (hardware FLOPs utilisation) counts the FLOPs
the step executes: causal attention blocks as the kernel runs them, the output head where the
compact loss runs it, recompute (:class:`Throughput`). Closeness to the peak is HFU.

The peak is a documented or computed hardware figure, never a measured matmul rate (that
differs per rank and per moment, and MFU against it can exceed 100%); the only measurement in it
is the CPU's vector clock, taken once per machine for the whole host by a probe of its own
(:mod:`msllm.kernels.clock_probe`), the same whether msllm's kernels are built or used:

* ``context.peak_tflops`` when set (any device);
* Ascend: :data:`ASCEND_PEAK_TFLOPS`, the vendor's published dense FP16 peak per chip;
* CPU: cores x FMA units x SIMD fp32 lanes x 2 (multiply + add) x clock, read from the CPU's
  own description (:func:`cpu_peak`), at the clock the probe's register-only FMA loop measured
  if that is higher (:func:`with_measured_clock`: the cores turbo above a described base or TSC
  clock), divided among the ranks sharing the host; unknown when the probe never ran (no g++);
  under ``compute_dtype: bfloat16`` (training's GEMMs on bfloat16 inputs, ``csrc/gemm_bf16.cc``)
  the peak of the unit those GEMMs run on instead (:func:`bf16_gemm_peak`), since MFU is always
  against the peak of the arithmetic the model's FLOPs are done in;
* otherwise unknown: MFU is not reported (better than a guessed number).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

# Dense FP16 peak per chip, TFLOP/s, with its source. Huawei publishes no per-chip peak for the
# Ascend 910B variants (B1..B4) that we could cite, so they are not listed: set
# context.peak_tflops for them (the figure of your contract or datasheet).
ASCEND_PEAK_TFLOPS = {
    # Huawei, "DaVinci: A Scalable Architecture for Neural Network Computing", Hot Chips 31 (2019),
    # and the Ascend 910 launch (2019-08-23): 256 TFLOPS FP16 (32 DaVinci cores).
    "ascend910a": (256.0, "Ascend 910 (910A): 256 TFLOPS FP16, Huawei Hot Chips 31 (2019)"),
    "ascend910": (256.0, "Ascend 910 (910A): 256 TFLOPS FP16, Huawei Hot Chips 31 (2019)"),
}


# ---------------------------------------------------------------------------------------------
# CPU peak from the CPU's description


@dataclass(frozen=True)
class CpuPeak:
    """The factors of a CPU peak: ``tflops = cores * fma_units * lanes * 2 * ghz / 1000``."""

    cores: int
    fma_units: int
    lanes: int
    ghz: float
    isa: str
    clock_source: str
    fma_assumption: str

    @property
    def tflops(self) -> float:
        return self.cores * self.fma_units * self.lanes * 2 * self.ghz / 1000.0

    def describe(self) -> str:
        return (f"{self.cores} core(s) x {self.fma_units} FMA unit(s) x {self.lanes} fp32 lanes ({self.isa}) "
                f"x 2 FLOPs (multiply-add) x {self.ghz:.3f} GHz ({self.clock_source}) = {self.tflops:.4f} TFLOP/s; "
                f"{self.fma_assumption}")


def _cpuinfo_blocks(text: str) -> list[dict]:
    blocks, cur = [], {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                blocks.append(cur)
            cur = {}
            continue
        key, _, value = line.partition(":")
        cur[key.strip()] = value.strip()
    if cur:
        blocks.append(cur)
    return [b for b in blocks if "processor" in b]


def cpu_peak(cpuinfo: str, allowed_cpus: Optional[set] = None, base_khz: Optional[int] = None) -> CpuPeak:
    """The fp32 peak of the CPUs in ``cpuinfo`` (the text of ``/proc/cpuinfo``).

    * cores: physical cores (distinct ``physical id``/``core id``) among the logical CPUs in
      ``allowed_cpus`` (the process's affinity; all if None); hyper-threads share FMA units.
    * lanes: fp32 per SIMD register from the flags: ``avx512f`` 16, ``avx``/``avx2`` 8, else 4.
    * FMA units per core, in 512-bit equivalents with ``avx512f``: 2 on a Xeon (Skylake-SP
      Gold/Platinum and later server cores have two 512-bit FMA units; a few Silver/Bronze parts
      have one, which this overstates the peak for, so MFU errs low); 1 on an AMD family 19h core
      (Zen 4: two 256-bit FMA pipes, a 512-bit FMA issues as two 256-bit halves; AMD, "Software
      Optimization Guide for the AMD Zen4 Microarchitecture", pub. 57647, section 2.11, and
      ``benchmarks/cpu_peak.py`` measures one such FMA per cycle per core); 2 on AMD family 1Ah
      and later (Zen 5, 512-bit data paths); 1 on other cores (client cores). 2 with ``avx2`` +
      ``fma`` (Haswell and later, Zen 2 and later), except 1 on AMD Zen / Zen+ (family 17h, models
      below 30h: two 128-bit FMA pipes, a 256-bit FMA issues as two halves; AMD, "Software
      Optimization Guide for AMD Family 17h Processors", pub. 55723, section 2.11); 1 without
      FMA (a multiply and an add port).
    * clock: the base clock in the model name (``@ 2.30GHz``), else ``base_khz``
      (``/sys/devices/system/cpu/cpu0/cpufreq/base_frequency``), else ``cpu MHz``.

    Raises ValueError if ``cpuinfo`` lists no processor or no clock.
    """
    blocks = _cpuinfo_blocks(cpuinfo)
    if allowed_cpus is not None:
        blocks = [b for b in blocks if int(b["processor"]) in allowed_cpus] or blocks
    if not blocks:
        raise ValueError("cpuinfo lists no processor")
    cores = len({(b.get("physical id"), b.get("core id", b["processor"])) for b in blocks})
    first = blocks[0]
    flags = set(first.get("flags", "").split())
    model = first.get("model name", "")
    xeon = "xeon" in model.lower()
    amd_family = int(first.get("cpu family", "0") or 0) if first.get("vendor_id") == "AuthenticAMD" else 0
    if "avx512f" in flags:
        lanes, isa = 16, "avx512f"
        if xeon:
            units, why = 2, "assumes 2 AVX-512 FMA units per core (Xeon server core)"
        elif amd_family == 0x19:
            units, why = 1, "AMD Zen 4: two 256-bit FMA pipes = one 512-bit FMA per cycle per core"
        elif amd_family >= 0x1A:
            units, why = 2, "AMD Zen 5 or later: two 512-bit FMA pipes per core"
        else:
            units, why = 1, "assumes 1 AVX-512 FMA unit per core (client core)"
    elif "avx2" in flags and "fma" in flags and amd_family == 0x17 and int(first.get("model", "0") or 0) < 0x30:
        lanes, isa, units, why = 8, "avx2+fma", 1, ("AMD Zen / Zen+ (family 17h, model < 30h): two 128-bit FMA "
                                                     "pipes = one 256-bit FMA per cycle per core")
    elif "avx2" in flags and "fma" in flags:
        lanes, isa, units, why = 8, "avx2+fma", 2, "assumes 2 FMA units per core (Haswell and later)"
    elif "avx" in flags:
        lanes, isa, units, why = 8, "avx", 1, "no FMA: one multiply and one add port"
    else:
        lanes, isa, units, why = 4, "sse", 1, "no FMA: one multiply and one add port"
    m = re.search(r"@\s*([\d.]+)\s*GHz", model)
    if m:
        ghz, source = float(m.group(1)), "base clock in the model name"
    elif base_khz:
        ghz, source = base_khz / 1e6, "cpufreq base_frequency"
    elif first.get("cpu MHz"):
        ghz, source = float(first["cpu MHz"]) / 1000.0, "cpuinfo cpu MHz"
    else:
        raise ValueError("cpuinfo gives no clock (model name, cpu MHz)")
    return CpuPeak(cores, units, lanes, ghz, isa, source, why)


def with_measured_clock(peak: CpuPeak, fma_loop: Optional[dict]) -> CpuPeak:
    """``peak`` at the clock the cores were measured running vector FMAs at, when that is above
    the described one (a KVM guest's ``cpu MHz`` is the TSC rate; the cores turbo above it, and a
    GEMM could then reach more than the described peak, i.e. MFU over 100%).

    ``fma_loop``: ``{"threads", "lanes", "gflops"}`` of a register-only FMA loop on every core
    (:func:`msllm.kernels.clock_probe.measure_fma_loop`, recorded by the clock probe); its clock
    is gflops / threads / (fma_units x lanes x 2). Ignored when None or measured with other lanes.
    """
    if not fma_loop or fma_loop.get("lanes") != peak.lanes or not fma_loop.get("threads"):
        return peak
    ghz = float(fma_loop["gflops"]) / int(fma_loop["threads"]) / (peak.fma_units * peak.lanes * 2)
    if ghz <= peak.ghz:
        return peak
    return dataclasses.replace(peak, ghz=ghz, clock_source=(
        f"a register-only FMA loop (msllm's clock probe: {float(fma_loop['gflops']):.1f} GFLOP/s on "
        f"{fma_loop['threads']} cores), above {peak.ghz:.3f} GHz from {peak.clock_source}"))


def measured_fma_loop() -> Optional[dict]:
    """The FMA loop measured on this CPU by msllm's clock probe (:mod:`msllm.kernels.clock_probe`,
    independent of the kernel library), or None when it was never measured here."""
    from msllm.kernels.clock_probe import read_clock_probe

    return read_clock_probe()


def host_cpu_peak(fma_loop: Optional[dict] = None) -> CpuPeak:
    """:func:`cpu_peak` of this machine, for the CPUs this process may run on, at the clock the
    cores were measured running FMAs at when that is higher (:func:`with_measured_clock`);
    ``fma_loop``: the clock probe's record, read with :func:`measured_fma_loop` when not given."""
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        text = fh.read()
    base = None
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/base_frequency", encoding="utf-8") as fh:
            base = int(fh.read().strip())
    except (OSError, ValueError):
        pass
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return with_measured_clock(cpu_peak(text, allowed, base), fma_loop or measured_fma_loop())


# AMX-BF16: one TDPBF16PS multiplies a 16x32 by a 32x16 bfloat16 tile into 16x16 float32 sums, 16 x 16 x 32
# multiply-adds = 16384 FLOPs, issued once per 16 cycles per core: 1024 bfloat16 FLOPs per cycle per core
# (Intel, "4th Gen Intel Xeon Scalable Processors" product brief: "1024 BF16 operations per cycle"; Intel 64 and
# IA-32 Architectures Optimization Reference Manual, chapter "Intel Advanced Matrix Extensions").
AMX_BF16_FLOPS_PER_CYCLE = 1024


def bf16_gemm_peak(peak: CpuPeak, flags: set, native: bool) -> tuple[float, str]:
    """``(TFLOP/s, how)``: the peak of bfloat16-input GEMMs with float32 sums on the cores of ``peak``
    (its cores and clock), for MFU under ``compute_dtype: bfloat16`` on CPU.

    * ``native`` False (msllm emulates the GEMMs: rounded inputs, float32 sgemm): the float32 peak.
    * ``amx_bf16`` in ``flags``: :data:`AMX_BF16_FLOPS_PER_CYCLE` x cores x clock.
    * otherwise (AVX512_BF16 or AVX-VNNI-style dot products): 2x the float32 peak: ``VDPBF16PS`` runs on
      the FMA units and sums two bfloat16 products into each float32 lane (Intel SDM vol. 2, VDPBF16PS).

    ``flags``: the CPU's ``/proc/cpuinfo`` flags; ``native``: :func:`msllm.kernels.gemm_bf16_native`."""
    if not native:
        return peak.tflops, ("bfloat16 GEMMs emulated on float32 FMAs (no bfloat16 unit oneDNN uses): the float32 "
                             f"peak, {peak.describe()}")
    if "amx_bf16" in flags:
        tflops = peak.cores * AMX_BF16_FLOPS_PER_CYCLE * peak.ghz / 1000.0
        return tflops, (f"bfloat16 GEMM peak (AMX-BF16): {peak.cores} core(s) x {AMX_BF16_FLOPS_PER_CYCLE} bf16 FLOPs "
                        f"per cycle x {peak.ghz:.3f} GHz ({peak.clock_source}) = {tflops:.4f} TFLOP/s")
    return 2 * peak.tflops, (f"bfloat16 GEMM peak (AVX512_BF16 dot products: 2 bf16 products per float32 lane "
                             f"on the FMA units) = 2 x the float32 peak = {2 * peak.tflops:.4f} TFLOP/s; "
                             f"float32 peak {peak.describe()}")


def ascend_soc_name() -> Optional[str]:
    """The Ascend chip name (e.g. ``Ascend910B2``) from pyACL's ``acl.get_soc_name()`` (CANN),
    or None where pyACL is not installed."""
    try:
        import acl  # pyACL, part of the CANN toolkit on Ascend hosts

        return acl.get_soc_name() or None
    except Exception:  # ImportError off Ascend; CANN raises its own errors without a device
        return None


def device_peak_tflops(device_target: str, override: Optional[float] = None, ascend_device: Optional[str] = None,
                       ranks_on_host: Optional[int] = None,
                       bf16_gemms: Optional[bool] = None) -> tuple[Optional[float], str]:
    """``(peak TFLOP/s of one device, how it was obtained)``; the peak is None when unknown.

    Args:
        device_target: ``Ascend``, ``CPU`` or ``GPU`` (``context.device_target``).
        override: ``context.peak_tflops``; used as given when set.
        ascend_device: the chip name (e.g. ``Ascend910A``); default :func:`ascend_soc_name`.
        ranks_on_host: ranks sharing this host's CPUs (CPU only); default env ``DEVICE_NUM`` (set
            by ``scripts/run_distribute.sh`` to the ranks it started here), else 1. The host peak
            is divided among them, so every rank logs the same peak and the ranks' MFUs add up
            to the host's.
        bf16_gemms: CPU only: None when the model computes in float32; True / False when its GEMMs run on
            bfloat16 inputs (``compute_dtype: bfloat16``) natively / emulated (:func:`bf16_gemm_peak`).
    """
    if override:
        return float(override), f"context.peak_tflops = {float(override):g} TFLOP/s"
    if device_target == "Ascend":
        ascend_device = ascend_device or ascend_soc_name()
        key = (ascend_device or "").lower().replace(" ", "")
        key = key if key.startswith("ascend") else f"ascend{key}"
        if key in ASCEND_PEAK_TFLOPS:
            value, source = ASCEND_PEAK_TFLOPS[key]
            return value, source
        return None, (f"no documented peak for Ascend device {ascend_device!r} (known: "
                      f"{', '.join(sorted(ASCEND_PEAK_TFLOPS))}); set context.peak_tflops to report MFU")
    if device_target == "CPU":
        if ranks_on_host is None:
            ranks_on_host = int(os.environ.get("DEVICE_NUM", "1") or 1)
        fma_loop = measured_fma_loop()
        if fma_loop is None:   # the described clock would overstate MFU on a turbo core
            return None, ("CPU peak unknown: the clock this CPU's cores run vector FMAs at was never measured "
                          "here (`python -m msllm.kernels.build` measures it, needs g++; make install runs it); "
                          "MFU and HFU are not reported (set context.peak_tflops to give a peak)")
        peak = host_cpu_peak(fma_loop)
        tflops, how = peak.tflops, f"CPU peak {peak.describe()}"
        if bf16_gemms is not None:
            from msllm.kernels.toolchain import cpu_flags   # this CPU's /proc/cpuinfo flags

            tflops, how = bf16_gemm_peak(peak, cpu_flags(), bf16_gemms)
            how = f"CPU {how}"
        share = tflops / max(1, ranks_on_host)
        if ranks_on_host > 1:
            how += f"; shared by {ranks_on_host} ranks on this host: {share:.4f} TFLOP/s per rank"
        return share, how
    return None, f"no peak known for {device_target}; set context.peak_tflops to report MFU"


def measure_cpu_peak_tflops(n: int = 2048, repeats: int = 3) -> float:
    """Best fp32 matmul rate of MindSpore's own CPU MatMul kernel in this process, in TFLOP/s
    (2 n^3 FLOPs per n x n matmul). A benchmark measurement (``benchmarks/``), not the MFU
    denominator: it varies per rank and moment (see :func:`device_peak_tflops`)."""
    import mindspore as ms
    from mindspore import ops

    rng = np.random.default_rng(0)
    a = ms.Tensor(rng.standard_normal((n, n), dtype=np.float32))
    b = ms.Tensor(rng.standard_normal((n, n), dtype=np.float32))
    matmul = ops.MatMul()
    matmul(a, b).asnumpy()  # warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        matmul(a, b).asnumpy()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best / 1e12


@dataclass
class Throughput:
    """Per-step throughput numbers for one device: tokens/s/device, model TFLOPs, MFU and HFU.

    Two utilisation figures, both against the same device peak:

    * **MFU** (model FLOPs utilisation, the PaLM / Megatron convention peers report, comparable
      across implementations): ``tgs * flops_per_token / peak`` with ``flops_per_token = 6N + 12
      L H D T`` (Chowdhery et al. 2022, appendix B): every weight's three matmuls at every position
      (the output head too), the full T x T attention score and value matmuls, no recompute.
    * **HFU** (hardware FLOPs utilisation: the FLOPs the step actually executes): the output head
      only at ``head_fraction`` of the positions (msllm's compact loss runs it where a target is),
      the attention matmuls as the kernel runs them (``attention_executed_factor`` x the model's
      12 L H D T: msllm's CPU flash kernel computes only the causal query-block x key prefix and
      recomputes the scores in the backward pass), plus the recomputed forward
      (``recompute_flops_per_token``). Closeness to the hardware's peak is HFU.

    Attributes:
        tokens_per_step: tokens one model replica (one data-parallel rank's share) processes per
            optimizer step (batch x accum x micro batches x seq_length).
        flops_per_token: model FLOPs per trained token (``6N + 12LHDT``, minus ``2 x`` the frozen
            LoRA base: weights without a gradient skip one of their three matmuls).
        peak_tflops: the device's peak in TFLOP/s, or None (then MFU and HFU are not reported).
        devices_per_replica: devices one replica occupies (model_parallel x pipeline_stage); its
            tokens are shared among them, so tokens/s/device divides by it.
        head_flops_per_token: the output head's share of ``flops_per_token`` (6 x vocab x hidden;
            4 x when the head is frozen).
        attention_flops_per_token: the ``12 L H D T`` term.
        attention_executed_factor: executed / model attention FLOPs (1.0: the composed T x T path).
        recompute_flops_per_token: FLOPs of the forward pass run again by recompute.
        idle_expert_flops_per_token: FLOPs of the routed experts a token did not choose that the
            step runs anyway (the dropless dispatch is dense over the experts,
            :mod:`msllm.models.llama.moe`): 6 x the idle expert parameters; with a capacity factor
            the buffer's E x capacity rows minus the k routed ones per token (negative when
            choices are dropped); in HFU, not in MFU.
    """

    tokens_per_step: int
    flops_per_token: float
    peak_tflops: Optional[float]
    devices_per_replica: int = 1
    head_flops_per_token: float = 0.0
    attention_flops_per_token: float = 0.0
    attention_executed_factor: float = 1.0
    recompute_flops_per_token: float = 0.0
    idle_expert_flops_per_token: float = 0.0

    def tgs(self, step_seconds: float) -> float:
        """Tokens per second per device."""
        return self.tokens_per_step / self.devices_per_replica / step_seconds

    def executed_flops_per_token(self, head_fraction: float = 1.0) -> float:
        """FLOPs the step executes per token (HFU's numerator, see the class doc)."""
        return (self.flops_per_token - self.head_flops_per_token * (1.0 - head_fraction)
                + self.attention_flops_per_token * (self.attention_executed_factor - 1.0)
                + self.recompute_flops_per_token + self.idle_expert_flops_per_token)

    def tflops(self, step_seconds: float) -> float:
        """Achieved model TFLOP/s per device (MFU's numerator)."""
        return self.tgs(step_seconds) * self.flops_per_token / 1e12

    def mfu(self, step_seconds: float) -> Optional[float]:
        """Model FLOPs utilisation (1.0 = the peak), or None without a peak."""
        if not self.peak_tflops:
            return None
        return self.tflops(step_seconds) / self.peak_tflops

    def hfu(self, step_seconds: float, head_fraction: float = 1.0) -> Optional[float]:
        """Hardware FLOPs utilisation: executed FLOPs over the peak, or None without a peak."""
        if not self.peak_tflops:
            return None
        return self.tgs(step_seconds) * self.executed_flops_per_token(head_fraction) / 1e12 / self.peak_tflops


def causal_block_fraction(seq_length: int, block_rows: int, window: Optional[int] = None) -> float:
    """Share of the T x T score matrix msllm's CPU flash kernel computes: query block i (of
    ``block_rows`` rows, starting at q0) against keys 0 .. end of block i, or with a sliding window
    W keys ``max(0, q0 - W + 1)`` .. end (``msllm/kernels/csrc/attention.cc``), so
    ``sum_i rows_i * keys_i / T^2`` (= (n + 1) / 2n for n equal blocks without a window: 56% at T = 512)."""
    t, b = seq_length, block_rows
    first = (lambda q0: max(0, q0 - window + 1)) if window else (lambda q0: 0)
    return sum(min(b, t - q0) * (min(q0 + b, t) - first(q0)) for q0 in range(0, t, b)) / float(t * t)


def flash_block_rows(seq_length: int) -> int:
    """Query rows per block of the CPU flash kernel (``block_rows`` in ``attention.cc``)."""
    return 128 if seq_length >= 768 else 64


# The CPU flash kernel's attention matmuls, per head and query-key pair, in units of T^2 D: forward
# Q K^T and P V (4), backward with the scores recomputed from the saved log-sum-exp: S again, dP =
# dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q (10): 14, against the model count's 12 (4 + 8).
FLASH_EXECUTED_PER_MODEL = 14.0 / 12.0


def throughput_for_run(run_config, peak_tflops: Optional[float], frozen_params: int = 0,
                       head_frozen: bool = False, flash_attention: bool = False,
                       grouped_experts: bool = False) -> Throughput:
    """:class:`Throughput` of a run: tokens per replica per step = batch_size x
    gradient_accumulation_steps x micro_batch_num (when pipelined) x seq_length, shared by
    model_parallel x pipeline_stage devices.

    ``frozen_params``: matmul weights that get no gradient (LoRA's frozen base): their weight
    gradient (2 of the 6 FLOPs per parameter and token) is not computed, so the model FLOPs per
    token are ``6N + 12LHDT - 2 * frozen_params``; ``head_frozen``: the output head is among them.
    ``flash_attention``: the attention runs msllm's CPU flash kernel (causal blocks, scores
    recomputed in the backward pass: :func:`causal_block_fraction`, :data:`FLASH_EXECUTED_PER_MODEL`).
    Recompute (``recompute_config.recompute``) adds the forward pass of the decoder layers again.
    ``grouped_experts``: the dropless experts run grouped (msllm's CPU kernels: the k routed
    experts per token only), else dense over the experts (every expert on every token)."""
    rc, pc, mc = run_config.runner_config, run_config.parallel_config, run_config.model_config
    micro = pc.micro_batch_num if pc.pipeline_stage > 1 else 1
    t = mc.seq_length
    tokens = rc.batch_size * rc.gradient_accumulation_steps * micro * t
    flops = mc.train_flops_per_token() - 2.0 * frozen_params
    head = (4.0 if head_frozen else 6.0) * mc.vocab_size * mc.hidden_size
    # the model count's attention (``train_flops_per_token``): T keys per query, min(W, T) with a window
    keys = t if mc.sliding_window is None else min(mc.sliding_window, t)
    attention = 12.0 * mc.num_layers * mc.num_heads * mc.head_dim * keys
    # executed / model count: the flash kernel's blocks, or the composed path's whole T x T square
    if flash_attention:
        factor = FLASH_EXECUTED_PER_MODEL * causal_block_fraction(t, flash_block_rows(t), mc.sliding_window) * t / keys
    else:
        factor = t / keys
    recompute = 0.0
    if getattr(run_config.recompute_config, "recompute", False):
        # the decoder layers' forward again: 2 x their matmul weights + the attention forward
        body = mc.matmul_params() - mc.vocab_size * mc.hidden_size
        recompute = 2.0 * body + attention / 3.0 * factor
    idle = 0.0 if grouped_experts else 6.0 * mc.idle_expert_params()
    moe = mc.moe_config
    if moe is not None and moe.capacity_factor:
        # the capacity dispatch runs E x capacity rows for the micro batch's N tokens, not E x N
        # (negative when it drops choices: fewer rows than the k N the model count has)
        from msllm.models.llama.moe import expert_capacity

        n = rc.batch_size * t
        rows_per_token = moe.expert_num * expert_capacity(n, moe.num_experts_chosen, moe.capacity_factor,
                                                          moe.expert_num) / n
        per_expert = 6.0 * 3 * mc.expert_size * mc.hidden_size
        layers = sum(mc.is_moe_layer(i) for i in range(mc.num_layers))
        idle = per_expert * layers * (rows_per_token - moe.num_experts_chosen)
    return Throughput(tokens, flops, peak_tflops, pc.model_parallel * pc.pipeline_stage, head, attention, factor,
                      recompute, idle)


__all__ = ["ASCEND_PEAK_TFLOPS", "AMX_BF16_FLOPS_PER_CYCLE", "CpuPeak", "bf16_gemm_peak", "cpu_peak",
           "host_cpu_peak", "ascend_soc_name", "device_peak_tflops",
           "measure_cpu_peak_tflops", "Throughput", "throughput_for_run", "causal_block_fraction", "flash_block_rows"]
