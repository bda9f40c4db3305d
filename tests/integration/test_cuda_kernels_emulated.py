"""The CUDA kernels' own source, compiled for the CPU with the SIMT emulation
(custom_ops/gpu/simt_emulation.h: a block's threads are OpenMP threads, __syncthreads a barrier),
against the NumPy references: the same checks tests/gpu/ runs on a GPU. What the emulation cannot
show (memory coalescing, speed, races the barrier hides) needs the GPU harness."""

from __future__ import annotations

import shutil

import pytest

from tests.gpu.kernel_checks import CHECKS
from tests.gpu.kernel_library import HostArrays, KernelLibrary, build_emulated_library
from tests.support.kernel_reference import DTYPES


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> KernelLibrary:
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the emulated kernels")
    return KernelLibrary(build_emulated_library(tmp_path_factory.mktemp("emulated_kernels")), HostArrays())


# With bf16 activations only: an 8-bit cache's checks (its rows are read and written by the same code under every
# activation dtype) and the sliding windows' and soft-caps' (the masking and capping act on the fp32 scores of
# any dtype). Each dtype's own loads and stores are covered by its other checks; the GPU harness runs every pair.
# The windows' checks under every dtype took 37 of this file's 165 s on a 2-core VM.
ACTIVATIONS_ONLY_IN_BF16 = ("check_paged_attention_window_and_softcap", "check_paged_attention_window_splits")
EMULATED = [
    pytest.param(check, dtype, id=f"{check.__name__.removeprefix('check_')}-{dtype}")
    for check in CHECKS
    for dtype in DTYPES
    if dtype == "bfloat16"
    or (getattr(check, "kv_cache_dtype", None) is None and check.__name__ not in ACTIVATIONS_ONLY_IN_BF16)
]


@pytest.mark.parametrize("check, dtype", EMULATED)
def test_cuda_kernel_source_matches_the_reference_when_emulated(emulated, check, dtype):
    check(emulated, dtype)
