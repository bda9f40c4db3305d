// Run-time choice of instruction set for the ops. The library is built for baseline x86-64: AVX2/FMA,
// AVX-512 and its dot-product extensions live only in functions compiled with target attributes (or
// inside a `#pragma GCC target` region), and are called only after the CPU reported the feature.
#pragma once

#include "isa.h"
#include "paddle/extension.h"

namespace bs {

// What an op runs with; every op needs at least AVX2 + FMA + F16C: refuse with an error rather than
// die of SIGILL.
inline Isa resolve_isa(int allowed) {
  if (!cpu_has_avx2_fma_f16c()) PD_THROW("blockserve custom ops need a CPU with AVX2, FMA and F16C");
  return allowed_isa(allowed);
}

}  // namespace bs
