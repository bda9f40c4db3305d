"""The custom kernels with their instruction sets capped (BLOCKSERVE_CPU_ISA), for tests that run each path this
CPU has: the AVX2 code, AVX-512F alone, and AVX-512 with AVX512-BF16."""

from __future__ import annotations

import pytest

from worker.kernels.cpu_isa import cpu_features
from worker.kernels.protocol import Kernels
from worker.kernels.selection import select_kernels

ISA_CAPS = ("avx2", "avx512", "all")


def custom_kernels_on(isa_cap: str) -> Kernels:
    """The custom kernels capped at `isa_cap` (built on first use); skips the test where the CPU lacks that set."""
    if isa_cap != "avx2" and "avx512f" not in cpu_features():
        pytest.skip("this CPU has no AVX-512F")
    if isa_cap == "all" and "avx512_bf16" not in cpu_features():
        pytest.skip("this CPU has no AVX512-BF16")
    return select_kernels("custom", isa_cap=isa_cap).kernels
