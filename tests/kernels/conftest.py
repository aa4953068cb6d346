"""Kernel tests: make sure msllm's CPU kernels are built (a no-op when ``make install`` built them;
on a fresh checkout this compiles them once, about 20 s), in PYNATIVE mode unless a test says."""

import pytest

from helpers import context_mode


@pytest.fixture(scope="session")
def kernels():
    """The operators of the built library (:class:`msllm.kernels.ops.CpuKernels`)."""
    from msllm.kernels import build, cpu_kernels

    build.build(verbose=False)
    return cpu_kernels()


@pytest.fixture
def graph_mode():
    """GRAPH_MODE for one test (tests/conftest.py's is per module)."""
    yield from context_mode("graph")
