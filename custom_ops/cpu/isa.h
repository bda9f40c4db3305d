// The instruction-set extensions a kernel may use beyond AVX2 + FMA + F16C: allowed by the caller
// (the ops' `isa` attribute) and reported by the running CPU. Plain C++: also used by code that
// does not include Paddle's headers.
#pragma once

namespace bs {

// Bits of the `isa` attribute of every op (0 forces AVX2); worker/kernels/cpu_isa.py names the same bits.
enum IsaBits : int { kAllowAvx512 = 1, kAllowAvx512Bf16 = 2, kAllowAvx512Vnni = 4 };

struct Isa {
  bool avx512 = false;  // AVX-512F
  bool bf16 = false;    // AVX512-BF16 (vdpbf16ps)
  bool vnni = false;    // AVX512-VNNI (vpdpbusd)
};

inline bool cpu_has_avx2_fma_f16c() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

inline Isa allowed_isa(int allowed) {
  Isa isa;
  isa.avx512 = (allowed & kAllowAvx512) && __builtin_cpu_supports("avx512f");
  isa.bf16 = isa.avx512 && (allowed & kAllowAvx512Bf16) && __builtin_cpu_supports("avx512bf16");
  isa.vnni = isa.avx512 && (allowed & kAllowAvx512Vnni) && __builtin_cpu_supports("avx512vnni");
  return isa;
}

}  // namespace bs
