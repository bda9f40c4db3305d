"""The CPU's instruction-set extensions, as /proc/cpuinfo reports them, and the set the custom CPU ops may use."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

REQUIRED_CPU_FEATURES = ("avx2", "fma", "f16c")
# AMX, and AVX512-VBMI beside it (the dequantizing GEMM's vpermb; custom_ops/cpu/isa.h): every AMX CPU has it.
AMX_CPU_FEATURES = ("amx_tile", "amx_bf16", "amx_int8", "avx512vbmi")
# The ops' `isa` attribute bits (custom_ops/cpu/isa.h): extensions allowed beyond AVX2 + FMA + F16C.
ISA_AVX512, ISA_AVX512_BF16, ISA_AVX512_VNNI, ISA_AMX = 1, 2, 4, 8
# Above these bits: from how many rows of x a GEMM of bf16 weights runs on oneDNN's matmul (0: never).
ONEDNN_ROWS_SHIFT = 8
# The most the ops may use (BLOCKSERVE_CPU_ISA): avx2 forces AVX2; avx512 allows AVX-512F only; avx512+bf16+vnni its
# dot products too, not AMX (what a CPU without AMX runs); all = what the CPU has.
ISA_CAPS = ("avx2", "avx512", "avx512+bf16+vnni", "all")

# Linux's arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): the process asks for the AMX tiles' register state.
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
# Tests only: "1" builds the ops with AMX's tile instructions emulated in C++ (custom_ops/cpu/amx_emulation.h), so
# that the AMX kernel set runs on a CPU without AMX.
AMX_EMULATION_VARIABLE = "BLOCKSERVE_TEST_AMX_EMULATION"


@dataclass(frozen=True)
class IsaSet:
    """The instruction-set extensions the custom ops use beyond AVX2 + FMA + F16C."""

    avx512: bool = False  # AVX-512F
    bf16: bool = False  # AVX512-BF16: bf16 weights multiplied with vdpbf16ps
    vnni: bool = False  # AVX512-VNNI: int8 weights multiplied with vpdpbusd
    amx: bool = False  # AMX-BF16 and AMX-INT8: the same weights multiplied in tiles from 16 rows of x
    # With bf16: GEMMs of bf16 weights from this many rows of x on oneDNN's matmul (0: never; layers/gemm_route.py
    # measures where it is faster)
    onednn_rows: int = 0

    @property
    def bits(self) -> int:
        extensions = ISA_AVX512 * self.avx512 | ISA_AVX512_BF16 * self.bf16 | ISA_AVX512_VNNI * self.vnni
        return extensions | ISA_AMX * self.amx | self.onednn_rows << ONEDNN_ROWS_SHIFT

    @property
    def name(self) -> str:
        """avx2, avx512, avx512+bf16, avx512+vnni, avx512+bf16+vnni or avx512+bf16+vnni+amx."""
        if not self.avx512:
            return "avx2"
        return "avx512" + "+bf16" * self.bf16 + "+vnni" * self.vnni + "+amx" * self.amx

    @classmethod
    def of(cls, features: set[str], cap: str = "all") -> IsaSet:
        """What this CPU (its /proc/cpuinfo flags) offers, up to `cap` (one of ISA_CAPS); AMX where the flags have it
        and Linux grants this process its tiles (os_grants_amx), as the ops themselves check."""
        if cap not in ISA_CAPS:
            raise ValueError(f"isa cap {cap!r} is not one of {ISA_CAPS}")
        avx512 = cap != "avx2" and "avx512f" in features
        extended = avx512 and cap != "avx512"
        bf16, vnni = extended and "avx512_bf16" in features, extended and "avx512_vnni" in features
        amx = bf16 and vnni and cap == "all" and has_amx(features)
        return cls(avx512, bf16, vnni, amx)


def has_amx(features: set[str]) -> bool:
    """Whether the ops may run AMX's tiles: the CPU has them and Linux grants them, or the ops are the tests' build
    that emulates them (amx_emulated) on a CPU with the rest of the AMX kernel set's instructions."""
    if amx_emulated():
        return "avx512vbmi" in features
    return all(f in features for f in AMX_CPU_FEATURES) and os_grants_amx()


def amx_emulated() -> bool:
    """Whether this process builds and loads the ops with AMX's tiles emulated (custom_ops/build.py reads the same
    variable; tests only)."""
    return os.environ.get(AMX_EMULATION_VARIABLE) == "1"


@functools.cache
def os_grants_amx() -> bool:
    """Whether Linux lets this process use the AMX tiles (it asks, once: the grant holds for the whole process)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def cpu_features() -> set[str]:
    """The instruction-set flags the kernel reports for this CPU (empty where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
