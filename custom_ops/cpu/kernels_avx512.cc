// The kernels compiled for AVX-512F; chosen only when the running CPU reports AVX-512F.
#include <immintrin.h>

#include "kernel_set.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace bs {
namespace avx512 {
#include "simd_avx512.h"
#include "kernel_impl.h"
}  // namespace avx512
}  // namespace bs
#pragma GCC pop_options

// Outside the region: called from baseline code.
const bs::KernelSet& bs::avx512_kernels() { return avx512::kKernels; }
