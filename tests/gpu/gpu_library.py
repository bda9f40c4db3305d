"""The kernels built by nvcc for this machine's GPU, over CuPy arrays (None where there is no GPU)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tests.gpu.kernel_library import CudaArrays, KernelLibrary, build_cuda_library

BUILD_DIR_VARIABLE = "BLOCKSERVE_KERNEL_BUILD_DIR"  # scripts/gpu_check.sh keeps the build with its output


class NoGpu(RuntimeError):
    """Why the GPU harness cannot run here."""


def find_nvcc() -> str:
    found = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)
    if found is None:
        raise NoGpu("nvcc is not installed")
    return found


def gpu_library() -> KernelLibrary:
    """Raises NoGpu without CuPy, a CUDA device or nvcc."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise NoGpu("no CUDA device")
    except ImportError as exc:
        raise NoGpu(f"CuPy is not installed ({exc})") from None
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise NoGpu(f"no usable CUDA device ({exc})") from None
    compute_capability = cupy.cuda.Device().compute_capability  # "90" on an H100/H200
    build_dir = Path(os.environ.get(BUILD_DIR_VARIABLE) or Path(tempfile.gettempdir()) / "blockserve_kernels")
    return KernelLibrary(build_cuda_library(build_dir, find_nvcc(), compute_capability), CudaArrays())
