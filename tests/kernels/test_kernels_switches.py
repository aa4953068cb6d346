"""msllm.kernels.check_environment: every kernel switch of the environment (KERNEL_SWITCHES, read by
csrc/switches.h, and once per process csrc/pool.h, aot.h, stream.h, gemm.h) refuses a value it does not take with one error naming the variable,
and takes its documented values; docs/kernels.md's "Switches" table lists the same variables."""

import os
import re

import pytest

from msllm.errors import MsllmError
from msllm.kernels import KERNEL_SWITCHES, check_environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (variable, values it takes, values it refuses): written out here, not derived from the table
CASES = [
    ("MSLLM_GEMV_PREFETCH", ["0", "64", "8192"], ["-1", "8k", "1.5", " 64"]),
    ("MSLLM_GEMV_PREFETCH_FAR", ["0", "32768"], ["-5", "32KiB", "0x100"]),
    ("MSLLM_GEMV_SPLIT", ["ranges", "chunks"], ["chunk", "1", "RANGES"]),
    ("MSLLM_GEMV_ROWS", ["2", "8"], ["4", "16", "two"]),
    ("MSLLM_GEMV_MAX_ROWS", ["4", "8"], ["2", "9"]),
    ("MSLLM_GEMV_ISA", ["avx512", "avx2", "none"], ["sse", "AVX2", "avx"]),
    ("MSLLM_NO_GEMV", ["1"], ["0", "yes"]),
    ("MSLLM_INT8_ISA", ["avx512", "avx2", "scalar"], ["vnni", "none"]),
    ("MSLLM_DECODE_ATTENTION", ["generic"], ["generc", "fixed"]),
    ("MSLLM_GEMM_BF16", ["emulate"], ["native", "1"]),
    ("MSLLM_GEMM", ["slabs"], ["interop", "slab"]),
    ("MSLLM_KERNEL_THREADS", ["1", "7"], ["0", "-2", "two"]),
    ("MSLLM_KERNEL_PROFILE", ["0", "1"], ["true", "2"]),
    ("MSLLM_NO_HUGE_PAGES", ["1"], ["0", "on"]),
]

INTEGERS = {"MSLLM_GEMV_PREFETCH", "MSLLM_GEMV_PREFETCH_FAR", "MSLLM_KERNEL_THREADS"}


@pytest.fixture
def clean_env(monkeypatch):
    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_cases_cover_every_switch():
    assert sorted(name for name, _, _ in CASES) == sorted(KERNEL_SWITCHES)


@pytest.mark.parametrize("name,good,bad", CASES, ids=[c[0] for c in CASES])
def test_each_switch_takes_its_values_and_refuses_others_by_name(clean_env, name, good, bad):
    check_environment()                      # all unset
    for v in good + [""]:                    # empty: the default
        clean_env.setenv(name, v)
        check_environment()
    for v in bad:
        clean_env.setenv(name, v)
        with pytest.raises(MsllmError) as err:
            check_environment()
        msg = str(err.value)
        assert msg.startswith(f"{name}={v!r}: expected "), msg
        if name in INTEGERS:
            assert "integer" in msg, msg
        else:                                # a fixed set of values: each is named in the error
            assert all(repr(g) in msg for g in good), msg


def test_the_docs_table_lists_every_switch():
    with open(os.path.join(ROOT, "docs", "kernels.md")) as fh:
        text = fh.read()
    section = text[text.index("## Switches"):text.index("## Tests and tolerances")]
    listed = set(re.findall(r"`(MSLLM_[A-Z0-9_]+)`", section))
    assert listed == set(KERNEL_SWITCHES)
