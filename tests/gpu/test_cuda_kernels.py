"""Each CUDA kernel on this machine's GPU against the NumPy references (the checks the CPU tests run
on the emulated kernels), plus a decode batch as large as the benchmark's. Skipped without CuPy, a
GPU or nvcc; scripts/gpu_check.sh runs the same checks without pytest."""

from __future__ import annotations

import pytest

from tests.gpu.gpu_library import NoGpu, gpu_library
from tests.gpu.kernel_checks import CHECKS, GPU_ONLY_CHECKS
from tests.support.kernel_reference import DTYPES


@pytest.fixture(scope="module")
def gpu():
    try:
        return gpu_library()
    except NoGpu as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("check", CHECKS + GPU_ONLY_CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_cuda_kernel_matches_the_reference_on_the_gpu(gpu, check, dtype):
    check(gpu, dtype)
