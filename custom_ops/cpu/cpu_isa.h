// Run-time choice of instruction set. The library is built for baseline x86-64: AVX2/FMA and
// AVX-512 code lives only in functions compiled with these target attributes (or inside a
// `#pragma GCC target` region), and is called only after the CPU reported the feature.
#pragma once

#include "paddle/extension.h"

#define BS_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define BS_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))

namespace bs {

// The AVX-512 path when the op was asked for it (the `avx512` attribute: false forces AVX2)
// and the running CPU has AVX-512F.
inline bool use_avx512(bool allowed) { return allowed && __builtin_cpu_supports("avx512f"); }

// Every op needs at least AVX2 + FMA; refuse with an error rather than die of SIGILL.
inline void require_avx2_fma() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    PD_THROW("blockserve custom ops need a CPU with AVX2 and FMA");
  }
}

}  // namespace bs
