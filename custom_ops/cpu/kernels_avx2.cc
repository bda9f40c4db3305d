// The kernels compiled for AVX2 + FMA (the baseline of the custom path).
#include <immintrin.h>

#include "kernel_set.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace bs {
namespace avx2 {
#include "simd_avx2.h"
#include "kernel_impl.h"
}  // namespace avx2
}  // namespace bs
#pragma GCC pop_options

// Outside the region: called from baseline code.
const bs::KernelSet& bs::avx2_kernels() { return avx2::kKernels; }
