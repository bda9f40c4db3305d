"""The custom kernels with their instruction sets capped (BLOCKSERVE_CPU_ISA), for tests that run each path this
CPU has: the AVX2 code, AVX-512F alone, AVX-512 with its dot products (AVX512-BF16, AVX512-VNNI) without AMX, and
everything the CPU has, where that includes AMX's tiles (else it is the path before, tested as that)."""

from __future__ import annotations

import pytest

from worker.kernels.cpu_isa import IsaSet, cpu_features
from worker.kernels.protocol import Kernels
from worker.kernels.selection import select_kernels

ISA_CAPS = ("avx2", "avx512", "avx512+bf16+vnni", "all")


def custom_kernels_on(isa_cap: str) -> Kernels:
    """The custom kernels capped at `isa_cap` (built on first use); skips the test where the CPU lacks that set,
    saying why."""
    features = cpu_features()
    if isa_cap != "avx2" and "avx512f" not in features:
        pytest.skip("this CPU has no AVX-512F")
    if isa_cap == "avx512+bf16+vnni" and not {"avx512_bf16", "avx512_vnni"} & features:
        pytest.skip("this CPU has neither AVX512-BF16 nor AVX512-VNNI")
    if isa_cap == "all" and not IsaSet.of(features).amx:
        pytest.skip("this CPU has no AMX-BF16 and AMX-INT8 (or Linux does not grant this process their tiles)")
    kernels = select_kernels("custom", isa_cap=isa_cap).kernels
    assert kernels.isa.avx512 == (isa_cap != "avx2")
    assert kernels.isa.bf16 == (isa_cap in ("avx512+bf16+vnni", "all") and "avx512_bf16" in features)
    assert kernels.isa.amx == (isa_cap == "all")
    return kernels
