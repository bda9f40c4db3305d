"""How blockserve's CUDA Paddle operators are built: one extension from the Paddle glue in gpu/*_ops.cu
over the Paddle-free kernel headers (gpu/*.cuh), for sm_80 (A100) and sm_90 (H100, H200).

Used by setup.py on a CUDA build of Paddle (the Dockerfile's GPU target), by the worker's loader
(worker/kernels/cuda_ops.py, a cached JIT build) and by the build test, which compiles every
Paddle-free .cu (gpu/kernel_api.cu) with the machine's nvcc for the same architectures.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

EXTENSION_NAME = "blockserve_cuda_ops"
SOURCE_DIR = Path(__file__).resolve().parent / "gpu"
DEFAULT_ARCHITECTURES = ("80", "90")
ARCHITECTURES_VARIABLE = "BLOCKSERVE_CUDA_ARCHS"  # e.g. "80;90" (the Dockerfile's CUDA_ARCHS)
PADDLE_GLUE = "paddle_glue.h"  # what every Paddle op source includes, and no Paddle-free one
CXX_FLAGS = ["-O3", "-std=c++17"]
# -ftz=false (nvcc's default, never --use_fast_math): fp8 e4m3 codes pass through fp32 subnormals (gpu/kv_rows.cuh).
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-ftz=false"]


def architectures() -> list[str]:
    listed = os.environ.get(ARCHITECTURES_VARIABLE, "")
    return [arch.strip() for arch in listed.replace(",", ";").split(";") if arch.strip()] or list(DEFAULT_ARCHITECTURES)


def gencode_flags(archs: list[str]) -> list[str]:
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs]


def nvcc_flags() -> list[str]:
    return [*NVCC_FLAGS, *gencode_flags(architectures())]


def _is_paddle_op(path: Path) -> bool:
    return f'#include "{PADDLE_GLUE}"' in path.read_text()


def op_sources(source_dir: Path = SOURCE_DIR) -> list[str]:
    """The Paddle glue: one source per group of ops."""
    return sorted(str(path) for path in source_dir.glob("*.cu") if _is_paddle_op(path))


def paddle_free_sources(source_dir: Path = SOURCE_DIR) -> list[str]:
    """Every .cu that needs no Paddle: what the build test compiles with plain nvcc."""
    return sorted(str(path) for path in source_dir.glob("*.cu") if not _is_paddle_op(path))


def source_hash(source_dir: Path = SOURCE_DIR) -> str:
    """Changes whenever a source, header or flag does: names the JIT build's cache folder."""
    digest = hashlib.sha256(repr((CXX_FLAGS, nvcc_flags())).encode())
    for path in sorted(source_dir.glob("*")):
        if path.suffix in (".cu", ".cuh", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]
