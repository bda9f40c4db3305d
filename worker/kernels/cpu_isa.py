"""The CPU's instruction-set extensions, as /proc/cpuinfo reports them, and the set the custom CPU ops may use."""

from __future__ import annotations

from dataclasses import dataclass

REQUIRED_CPU_FEATURES = ("avx2", "fma", "f16c")
# The ops' `isa` attribute bits (custom_ops/cpu/isa.h): extensions allowed beyond AVX2 + FMA + F16C.
ISA_AVX512, ISA_AVX512_BF16, ISA_AVX512_VNNI = 1, 2, 4
ISA_CAPS = ("avx2", "avx512", "all")  # avx2 forces AVX2; avx512 allows AVX-512F only; all = what the CPU has


@dataclass(frozen=True)
class IsaSet:
    """The instruction-set extensions the custom ops use beyond AVX2 + FMA + F16C."""

    avx512: bool = False  # AVX-512F
    bf16: bool = False  # AVX512-BF16: bf16 weights multiplied with vdpbf16ps
    vnni: bool = False  # AVX512-VNNI: int8 weights multiplied with vpdpbusd

    @property
    def bits(self) -> int:
        return ISA_AVX512 * self.avx512 | ISA_AVX512_BF16 * self.bf16 | ISA_AVX512_VNNI * self.vnni

    @property
    def name(self) -> str:
        """avx2, avx512, avx512+bf16, avx512+vnni or avx512+bf16+vnni."""
        if not self.avx512:
            return "avx2"
        return "avx512" + "+bf16" * self.bf16 + "+vnni" * self.vnni

    @classmethod
    def of(cls, features: set[str], cap: str = "all") -> IsaSet:
        """What this CPU (its /proc/cpuinfo flags) offers, up to `cap` (one of ISA_CAPS)."""
        if cap not in ISA_CAPS:
            raise ValueError(f"isa cap {cap!r} is not one of {ISA_CAPS}")
        avx512 = cap != "avx2" and "avx512f" in features
        extended = avx512 and cap == "all"
        return cls(avx512, extended and "avx512_bf16" in features, extended and "avx512_vnni" in features)


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
