"""Kernel tests: make sure msllm's CPU kernels are built (a no-op when ``make install`` built them;
on a fresh checkout this compiles them once, about 20 s), in PYNATIVE mode unless a test says."""

import pytest

import mindspore as ms


@pytest.fixture(scope="session")
def kernels():
    """The operators of the built library (:class:`msllm.kernels.ops.CpuKernels`)."""
    from msllm.kernels import build, cpu_kernels

    build.build(verbose=False)
    return cpu_kernels()


@pytest.fixture
def pynative():
    ms.set_device("CPU")
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=previous)


@pytest.fixture
def graph_mode():
    ms.set_device("CPU")
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=previous)
