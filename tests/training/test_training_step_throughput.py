"""The MFU denominator: a documented or computed device peak, the same on every rank, never
below what the hardware measurably does; tokens/s/device shared by the devices of a replica."""

import os

import pytest

from msllm.config import load_config
from msllm.training.throughput import (Throughput, cpu_peak, device_peak_tflops, host_cpu_peak,
                                       measure_cpu_peak_tflops, throughput_for_run)


def cpuinfo(n_logical, model, flags, mhz="2600.000", cores_per_socket=None):
    """A /proc/cpuinfo text: ``n_logical`` CPUs, hyper-threads paired on cores when
    ``cores_per_socket`` < n_logical."""
    cores = cores_per_socket or n_logical
    return "\n\n".join(
        f"processor\t: {i}\nmodel name\t: {model}\ncpu MHz\t\t: {mhz}\nphysical id\t: 0\n"
        f"core id\t\t: {i % cores}\ncpu cores\t: {cores}\nflags\t\t: {flags}" for i in range(n_logical)) + "\n"


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
