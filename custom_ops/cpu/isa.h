// The instruction-set extensions a kernel may use beyond AVX2 + FMA + F16C: allowed by the caller
// (the ops' `isa` attribute) and reported by the running CPU. Plain C++: also used by code that
// does not include Paddle's headers.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace bs {

// Bits of the `isa` attribute of every op (0 forces AVX2); worker/kernels/cpu_isa.py names the same bits. Above
// kOneDnnRowsShift: the fewest rows of x from which a GEMM of bf16 weights runs on oneDNN's matmul (0: never; see
// linear_onednn.h), which the worker measures at its start.
enum IsaBits : int { kAllowAvx512 = 1, kAllowAvx512Bf16 = 2, kAllowAvx512Vnni = 4, kAllowAmx = 8 };
constexpr int kOneDnnRowsShift = 8;

struct Isa {
  bool avx512 = false;  // AVX-512F
  bool bf16 = false;    // AVX512-BF16 (vdpbf16ps)
  bool vnni = false;    // AVX512-VNNI (vpdpbusd)
  bool amx = false;     // AMX-TILE, AMX-BF16 and AMX-INT8 (tdpbf16ps, tdpbsud), granted by the OS
  long onednn_rows = 0;  // with bf16: GEMMs of bf16 weights from this many rows on oneDNN's matmul (0: never)
};

inline bool cpu_has_avx2_fma_f16c() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// Whether the CPU has AMX-TILE, AMX-BF16 and AMX-INT8 (CPUID leaf 7) and Linux lets this process use the
// tiles: their 8 KiB register state is off until the process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA; the grant holds for every thread of the process, and asking again is harmless).
// Asked once per process. A test build that emulates the tiles (BS_AMX_EMULATION: amx_emulation.h) has them on
// any CPU.
inline bool cpu_has_amx() {
#ifdef BS_AMX_EMULATION
  return true;
#else
  static const bool granted = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24, kAmxInt8 = 1u << 25;
    if ((edx & (kAmxBf16 | kAmxTile | kAmxInt8)) != (kAmxBf16 | kAmxTile | kAmxInt8)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#endif
}

// AMX only above AVX512-BF16 and AVX512-VNNI (its kernels finish with them) and AVX512-VBMI (the dequantizing
// GEMM's vpermb); every AMX CPU has all three.
inline Isa allowed_isa(int allowed) {
  Isa isa;
  isa.avx512 = (allowed & kAllowAvx512) && __builtin_cpu_supports("avx512f");
  isa.bf16 = isa.avx512 && (allowed & kAllowAvx512Bf16) && __builtin_cpu_supports("avx512bf16");
  isa.vnni = isa.avx512 && (allowed & kAllowAvx512Vnni) && __builtin_cpu_supports("avx512vnni");
  isa.amx = isa.bf16 && isa.vnni && (allowed & kAllowAmx) && __builtin_cpu_supports("avx512vbmi") && cpu_has_amx();
  isa.onednn_rows = isa.bf16 ? static_cast<unsigned>(allowed) >> kOneDnnRowsShift : 0;
  return isa;
}

}  // namespace bs
