"""The CUDA kernels' own source, compiled for the CPU with the SIMT emulation
(custom_ops/gpu/simt_emulation.h: a block's threads are fibers taking turns, __syncthreads a barrier),
against the NumPy references: the same checks tests/gpu/ runs on a GPU. What the emulation cannot
show (memory coalescing, speed, races the barrier hides) needs the GPU harness."""

from __future__ import annotations

import pytest

from tests.gpu.kernel_checks import CHECKS
from tests.gpu.kernel_library import HostArrays, KernelLibrary
from tests.support.kernel_reference import DTYPES


@pytest.fixture(scope="module")
def emulated(emulated_kernels) -> KernelLibrary:
    return KernelLibrary(emulated_kernels, HostArrays())


# Every check under every activation dtype, as the GPU harness runs them (24 of these 54 cases ran under bf16 only
# while a block's threads were OpenMP threads: those 30 took 108 s on a 2-core Zen 4 VM; as fibers, all 54 take 42 s).
EMULATED = [
    pytest.param(check, dtype, id=f"{check.__name__.removeprefix('check_')}-{dtype}")
    for check in CHECKS
    for dtype in DTYPES
]


@pytest.mark.parametrize("check, dtype", EMULATED)
def test_cuda_kernel_source_matches_the_reference_when_emulated(emulated, check, dtype):
    check(emulated, dtype)
