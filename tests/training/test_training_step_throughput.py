"""The MFU denominator: a documented or computed device peak, the same on every rank, never
below what the hardware measurably does; tokens/s/device shared by the devices of a replica."""

import os

import numpy as np
import pytest

from msllm.config import load_config
from msllm.training.throughput import (CpuPeak, Throughput, bf16_gemm_peak, cpu_peak, device_peak_tflops, host_cpu_peak,
                                       measure_cpu_peak_tflops, throughput_for_run, with_measured_clock)


def cpuinfo(n_logical, model, flags, mhz="2600.000", cores_per_socket=None, vendor="GenuineIntel", family=6):
    """A /proc/cpuinfo text: ``n_logical`` CPUs, hyper-threads paired on cores when
    ``cores_per_socket`` < n_logical."""
    cores = cores_per_socket or n_logical
    return "\n\n".join(
        f"processor\t: {i}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel name\t: {model}\n"
        f"cpu MHz\t\t: {mhz}\nphysical id\t: 0\ncore id\t\t: {i % cores}\ncpu cores\t: {cores}\n"
        f"flags\t\t: {flags}" for i in range(n_logical)) + "\n"


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
XEON = "Intel(R) Xeon(R) Gold 6140 CPU @ 2.30GHz"


def test_cpu_peak_from_the_cpus_own_description():
    # 2 cores x 2 FMA units x 16 lanes x 2 x 2.3 GHz (the example)
    peak = cpu_peak(cpuinfo(2, XEON, "fpu sse avx avx2 fma avx512f"))
    assert peak.tflops == pytest.approx(0.2944)
    assert (peak.cores, peak.fma_units, peak.lanes, peak.ghz) == (2, 2, 16, 2.3)
    assert "base clock in the model name" in peak.describe() and "2 AVX-512 FMA units" in peak.describe()
    # hyper-threads share a core's FMA units: 4 logical CPUs on 2 cores count 2
    assert cpu_peak(cpuinfo(4, XEON, "avx2 fma avx512f", cores_per_socket=2)).cores == 2
    # only the CPUs this process may use
    assert cpu_peak(cpuinfo(8, XEON, "avx2 fma avx512f"), allowed_cpus={0, 1, 2}).cores == 3
    # AVX2 + FMA desktop, clock from cpu MHz when the model name has none: 4 x 2 x 8 x 2 x 3.0
    amd = cpu_peak(cpuinfo(4, "AMD Ryzen 5 Processor", "avx avx2 fma", mhz="3000.000"))
    assert amd.tflops == pytest.approx(0.384) and amd.clock_source == "cpuinfo cpu MHz"
    # AVX-512 outside a Xeon: one FMA unit assumed; cpufreq base_frequency (kHz) before cpu MHz
    client = cpu_peak(cpuinfo(1, "Intel Core Processor", "avx2 fma avx512f"), base_khz=2_000_000)
    assert (client.fma_units, client.ghz, client.clock_source) == (1, 2.0, "cpufreq base_frequency")
    assert cpu_peak(cpuinfo(1, "Old CPU", "sse sse2", mhz="1000")).tflops == pytest.approx(1 * 1 * 4 * 2 * 1.0 / 1000)
    with pytest.raises(ValueError, match="no processor"):
        cpu_peak("")


def test_cpu_peak_of_amd_avx512_cores():
    # Zen 4 (family 19h): a 512-bit FMA issues on its two 256-bit pipes, one per cycle per core
    zen4 = cpu_peak(cpuinfo(2, "AMD EPYC", "avx2 fma avx512f", mhz="2596.154", vendor="AuthenticAMD", family=25))
    assert (zen4.fma_units, zen4.lanes) == (1, 16) and "Zen 4" in zen4.fma_assumption
    assert zen4.tflops == pytest.approx(2 * 1 * 16 * 2 * 2.596154 / 1000)
    # Zen 5 (family 1Ah): 512-bit data paths, two FMA pipes
    zen5 = cpu_peak(cpuinfo(2, "AMD EPYC", "avx2 fma avx512f", vendor="AuthenticAMD", family=26))
    assert zen5.fma_units == 2


def test_a_measured_vector_clock_above_the_described_one_raises_the_peak():
    zen4 = cpu_peak(cpuinfo(2, "AMD EPYC", "avx2 fma avx512f", mhz="2596.154", vendor="AuthenticAMD", family=25))
    # this machine's numbers: the FMA loop reached 229.6 GFLOP/s on 2 cores = 3.588 GHz x 32 FLOP/cycle
    turbo = with_measured_clock(zen4, {"threads": 2, "lanes": 16, "gflops": 229.624})
    assert turbo.ghz == pytest.approx(229.624 / 2 / 32) and turbo.tflops == pytest.approx(0.229624)
    assert "FMA loop" in turbo.describe() and "2.596 GHz" in turbo.describe()
    # a slower loop (a loaded machine) never lowers it; a loop of other lanes (AVX2 build) is ignored
    assert with_measured_clock(zen4, {"threads": 2, "lanes": 16, "gflops": 100.0}) == zen4
    assert with_measured_clock(zen4, {"threads": 2, "lanes": 8, "gflops": 500.0}) == zen4
    assert with_measured_clock(zen4, None) == zen4
    # one core's loop: the clock is per core, whatever the host's core count
    assert with_measured_clock(zen4, {"threads": 1, "lanes": 16, "gflops": 115.0}).tflops == pytest.approx(0.230)


def test_host_peak_bounds_the_fma_loop_of_the_clock_probe():
    """The probe's FMA loop is the fastest fp32 code this CPU runs: the peak covers it."""
    from msllm.kernels.clock_probe import ensure_clock_probe

    loop = ensure_clock_probe(verbose=False)
    peak = host_cpu_peak()
    print(f"FMA loop {loop}, peak {peak.describe()}")
    assert loop["gflops"] / loop["threads"] * peak.cores <= peak.tflops * 1000 * (1 + 1e-9)


def test_cpu_peak_is_the_same_without_the_kernel_library_and_unknown_without_a_measured_clock(tmp_path,
                                                                                               monkeypatch):
    """The peak behind MFU / HFU depends on the clock probe only, never on whether msllm's kernel
    library exists (issue #21): a build directory holding only the probe's record gives the same
    peak as the full build; one without it gives no peak (no MFU) rather than the described clock."""
    import shutil

    from msllm.kernels import build as kernel_build
    from msllm.kernels.clock_probe import PROBE_INFO, ensure_clock_probe

    ensure_clock_probe(verbose=False)
    full = device_peak_tflops("CPU", ranks_on_host=1)
    assert full[0] is not None, full[1]
    only_probe = tmp_path / "only_probe"
    only_probe.mkdir()
    shutil.copy(os.path.join(kernel_build.build_dir(), PROBE_INFO), only_probe / PROBE_INFO)
    monkeypatch.setenv("MSLLM_KERNELS_DIR", str(only_probe))
    assert kernel_build.problem_with_build() is not None          # no library here ...
    assert device_peak_tflops("CPU", ranks_on_host=1) == full     # ... the same peak
    monkeypatch.setenv("MSLLM_KERNELS_DIR", str(tmp_path / "empty"))
    value, how = device_peak_tflops("CPU", ranks_on_host=1)
    assert value is None and "never measured" in how and "not reported" in how


def test_device_peak_is_documented_shared_per_rank_and_overridable():
    assert device_peak_tflops("CPU", override=12.5) == (12.5, "context.peak_tflops = 12.5 TFLOP/s")
    value, how = device_peak_tflops("Ascend", ascend_device="Ascend910A")
    assert value == 256.0 and "Hot Chips" in how
    value, how = device_peak_tflops("Ascend", ascend_device="Ascend910B3")
    assert value is None and "set context.peak_tflops" in how
    assert device_peak_tflops("GPU")[0] is None
    one, how1 = device_peak_tflops("CPU", ranks_on_host=1)
    two, how2 = device_peak_tflops("CPU", ranks_on_host=2)
    assert one == pytest.approx(host_cpu_peak().tflops) and two == pytest.approx(one / 2)
    assert "shared by 2 ranks" in how2 and "FMA" in how1
    assert device_peak_tflops("CPU", ranks_on_host=2) == (two, how2)  # no measurement: identical every call


def test_host_peak_bounds_a_measured_matmul():
    """MFU cannot exceed 100%: MindSpore's best fp32 matmul here stays below the computed peak."""
    import mindspore as ms

    ms.set_device("CPU")
    measured = measure_cpu_peak_tflops(n=1024, repeats=3)
    peak = host_cpu_peak()
    print(f"measured {measured:.4f} TFLOP/s, peak {peak.describe()}")
    assert 0 < measured <= peak.tflops


def test_tokens_per_device_divide_by_the_devices_of_a_replica():
    t = Throughput(tokens_per_step=4096, flops_per_token=1e9, peak_tflops=1.0, devices_per_replica=4)
    assert t.tgs(2.0) == 512.0 and t.tflops(2.0) == pytest.approx(512e9 / 1e12)
    assert t.mfu(2.0) == pytest.approx(0.512)
    cfg = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_70b.yaml"))  # model + pipeline parallel
    pc, rc, mc = cfg.parallel_config, cfg.runner_config, cfg.model_config
    run = throughput_for_run(cfg, 256.0)
    micro = pc.micro_batch_num if pc.pipeline_stage > 1 else 1
    assert run.devices_per_replica == pc.model_parallel * pc.pipeline_stage > 1
    assert run.tokens_per_step == rc.batch_size * rc.gradient_accumulation_steps * micro * mc.seq_length
    # over the whole job: every device's share adds up to the global tokens per step
    global_tokens = rc.batch_size * rc.gradient_accumulation_steps * micro * pc.data_parallel * mc.seq_length
    assert run.tgs(1.0) * pc.device_num == pytest.approx(global_tokens)


def test_an_mfu_above_100_percent_is_printed_and_warned_about_once(caplog):
    """A peak below what the device achieved is a wrong peak: the log line still shows the value,
    and one warning says to set context.peak_tflops (never a clamp that would hide it)."""
    import logging

    from msllm.training.monitor import LossMonitor, StepRecord

    # 1000 tokens x 1e9 FLOP per step of 1 s = 1 TFLOP/s against a 0.5 TFLOP/s peak: 200%
    monitor = LossMonitor(epochs=1, total_steps=3, throughput=Throughput(1000, 1.0e9, 0.5))
    with caplog.at_level(logging.WARNING, logger="msllm"):
        for step in (1, 2):
            monitor.records.append(StepRecord(step, 1, 2.0, 1.0, 1e-3, False, 1.0, 0.5))
            assert "MFU: 200.00%, HFU: 200.00%" in monitor.format(monitor.records[-1])
    warnings = [r for r in caplog.records if "above 100%" in r.getMessage()]
    assert len(warnings) == 1 and "context.peak_tflops" in warnings[0].getMessage()
    ok = LossMonitor(epochs=1, total_steps=1, throughput=Throughput(1000, 1.0e9, 2.0))
    ok.records.append(StepRecord(1, 1, 2.0, 1.0, 1e-3, False, 1.0, 0.5))
    assert "MFU: 50.00%, HFU: 50.00%" in ok.format(ok.records[-1]) and not ok.warned_peak


def test_mfu_counts_model_flops_and_hfu_the_flops_executed():
    """MFU: PaLM's 6N + 12LHDT (head at every position, full T x T attention), comparable across
    implementations. HFU: the head only at target positions (compact loss), the attention as the CPU
    flash kernel runs it (causal query blocks, scores recomputed backward: 14/12 of the model's
    matmuls on the computed share), the recomputed forward. Hand-checked numbers."""
    from msllm.training.control import target_count
    from msllm.training.throughput import causal_block_fraction

    cfg = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"))
    mc = cfg.model_config                       # seq 256: 4 query blocks of 64 rows
    assert causal_block_fraction(256, 64) == (1 + 2 + 3 + 4) / 16
    assert causal_block_fraction(512, 64) == 36 / 64 and causal_block_fraction(1024, 128) == 36 / 64
    # 300 = 4 x 64 + 44: sum rows_i x end_i = 64(64 + 128 + 192 + 256) + 44 x 300
    assert causal_block_fraction(300, 64) == pytest.approx((64 * (64 + 128 + 192 + 256) + 44 * 300) / 300 ** 2)
    run = throughput_for_run(cfg, 1.0, flash_attention=True)
    head = 6.0 * mc.vocab_size * mc.hidden_size
    attn = 12.0 * mc.num_layers * mc.num_heads * mc.head_dim * mc.seq_length
    assert run.head_flops_per_token == head and run.flops_per_token == mc.train_flops_per_token()
    assert run.mfu(1.0) == pytest.approx(run.tgs(1.0) * mc.train_flops_per_token() / 1e12)   # peak 1 TFLOP/s
    executed = mc.train_flops_per_token() - 0.75 * head + attn * (14 / 12 * 10 / 16 - 1)
    assert run.executed_flops_per_token(0.25) == pytest.approx(executed)
    assert run.hfu(1.0, 0.25) == pytest.approx(run.tgs(1.0) * executed / 1e12)
    composed = throughput_for_run(cfg, 1.0)       # the composed attention computes all of T x T
    assert composed.executed_flops_per_token(1.0) == composed.flops_per_token
    assert throughput_for_run(cfg, 1.0, head_frozen=True).head_flops_per_token == 4.0 * mc.vocab_size * mc.hidden_size
    cfg.recompute_config.recompute = True
    body = mc.matmul_params() - mc.vocab_size * mc.hidden_size
    assert throughput_for_run(cfg, 1.0).recompute_flops_per_token == pytest.approx(2 * body + attn / 3)
    # (B, T+1) labels: targets are labels[:, 1:]; 3 of the 8 target positions are ignored
    labels = np.array([[7, -100, 5, 6, 9], [-100, -100, -100, 3, 4]], np.int32)
    assert target_count(labels, -100) == (5, 8)


def test_sliding_window_counts_the_band_in_mfu_and_the_kernel_blocks_in_hfu():
    """Mistral's window W = 64 at T = 256: the model count's attention takes min(W, T) keys per query;
    the flash kernel computes block i's keys max(0, q0 - W + 1) .. q0 + 63 (hand-counted: 64 keys
    for the first block, 127 for the three others); the composed path computes all of T x T."""
    from msllm.training.throughput import causal_block_fraction

    assert causal_block_fraction(256, 64, window=64) == (64 * 64 + 3 * 64 * 127) / 256 ** 2
    assert causal_block_fraction(256, 64, window=1000) == causal_block_fraction(256, 64)
    cfg = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"),
                      ["--model.model_config.sliding_window=64"])
    mc = cfg.model_config
    attn = 12.0 * mc.num_layers * mc.num_heads * mc.head_dim * 64
    run = throughput_for_run(cfg, 1.0, flash_attention=True)
    assert run.flops_per_token == mc.train_flops_per_token()
    executed = mc.train_flops_per_token() + attn * (14 / 12 * (64 * 64 + 3 * 64 * 127) / 256 ** 2 * 256 / 64 - 1)
    assert run.executed_flops_per_token(1.0) == pytest.approx(executed)
    composed = throughput_for_run(cfg, 1.0)
    assert composed.executed_flops_per_token(1.0) == pytest.approx(mc.train_flops_per_token() + attn * 3)


def test_cpu_peak_share_follows_the_group_size_and_refuses_a_stale_device_num(monkeypatch):
    """A stale DEVICE_NUM=8 in a 1-rank job would divide the peak by 8 and multiply MFU by 8: refused.
    Without DEVICE_NUM the host's peak is shared by the group's ranks."""
    from helpers import TINY_YAML
    from msllm.config import load_config
    from msllm.errors import MsllmError
    from msllm.training.throughput import host_cpu_peak
    from msllm.training.setup import peak_tflops

    cfg = load_config(TINY_YAML, [])
    host = host_cpu_peak().tflops
    monkeypatch.setenv("DEVICE_NUM", "8")
    with pytest.raises(MsllmError, match="DEVICE_NUM='8' does not fit this job of 1 rank"):
        peak_tflops(cfg, 1)
    monkeypatch.setenv("DEVICE_NUM", "2")
    assert peak_tflops(cfg, 4)[0] == pytest.approx(host / 2)
    monkeypatch.delenv("DEVICE_NUM")
    assert peak_tflops(cfg, 1)[0] == pytest.approx(host)
    assert peak_tflops(cfg, 2)[0] == pytest.approx(host / 2)


def test_host_peak_bounds_the_fastest_gemm_measurable_here():
    """No GEMM on this machine may beat the peak MFU divides by: numpy's sgemm (OpenBLAS, all
    cores) at 2048^3, best of 5 runs, must not exceed it."""
    import time

    rng = np.random.default_rng(0)
    a = rng.standard_normal((2048, 2048), dtype=np.float32)
    b = rng.standard_normal((2048, 2048), dtype=np.float32)
    best = min(_timed(lambda: a @ b) for _ in range(5))
    rate = 2 * 2048 ** 3 / best / 1e12
    peak = host_cpu_peak()
    print(f"numpy sgemm {rate * 1000:.1f} GFLOP/s = {100 * rate / peak.tflops:.0f}% of peak {peak.describe()}")
    assert 0 < rate <= peak.tflops


def _timed(fn) -> float:
    import time

    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_cpu_peak_of_amd_zen1_cores():
    """Zen / Zen+ (family 17h, model < 30h, e.g. EPYC 7001 'Naples', model 1) run a 256-bit FMA as
    two 128-bit halves: one per cycle per core. Zen 2 (model 31h, 'Rome') has two 256-bit pipes."""
    zen1 = cpu_peak(cpuinfo(2, "AMD EPYC", "fpu avx avx2 fma", mhz="1996.249", vendor="AuthenticAMD",
                            family=23).replace("model name", "model\t\t: 1\nmodel name"))
    assert (zen1.fma_units, zen1.lanes) == (1, 8) and zen1.tflops == pytest.approx(2 * 1 * 8 * 2 * 1.996249 / 1000)
    zen2 = cpu_peak(cpuinfo(2, "AMD EPYC 7B12", "fpu avx avx2 fma", mhz="2250.000", vendor="AuthenticAMD",
                            family=23).replace("model name", "model\t\t: 49\nmodel name"))
    assert zen2.fma_units == 2


def test_bf16_gemm_peak_is_the_unit_the_gemms_run_on():
    """MFU under compute_dtype bfloat16 is against the bfloat16 unit's peak (hand-computed): AMX-BF16
    1024 FLOPs per cycle per core (Intel's figure), AVX512_BF16 dot products twice the float32 FMA rate,
    the float32 peak where msllm emulates the bfloat16 GEMMs."""
    peak = CpuPeak(cores=2, fma_units=2, lanes=16, ghz=2.0, isa="avx512f", clock_source="test", fma_assumption="test")
    assert peak.tflops == pytest.approx(0.256)                     # 2 x 2 x 16 x 2 x 2.0 GHz
    amx, how = bf16_gemm_peak(peak, {"avx512f", "avx512_bf16", "amx_bf16"}, native=True)
    assert amx == pytest.approx(4.096) and "AMX" in how           # 2 cores x 1024 x 2.0 GHz
    dot, how = bf16_gemm_peak(peak, {"avx512f", "avx512_bf16"}, native=True)
    assert dot == pytest.approx(0.512) and "AVX512_BF16" in how
    emulated, how = bf16_gemm_peak(peak, {"avx512f", "amx_bf16"}, native=False)
    assert emulated == pytest.approx(0.256) and "emulated" in how
    # on this machine: the ratio to the float32 peak follows the CPU's flags and oneDNN's choice
    from msllm import kernels
    from msllm.kernels.toolchain import cpu_flags

    f32, _ = device_peak_tflops("CPU", ranks_on_host=1)
    bf16, how = device_peak_tflops("CPU", ranks_on_host=1, bf16_gemms=kernels.gemm_bf16_native())
    host = host_cpu_peak()
    amx_ratio = 1024 / (host.fma_units * host.lanes * 2)            # per-core-cycle FLOPs: AMX over float32 FMAs
    expect = 1.0 if not kernels.gemm_bf16_native() else amx_ratio if "amx_bf16" in cpu_flags() else 2.0
    assert bf16 / f32 == pytest.approx(expect), how
