// The AVX-512 kernels with AVX512-BF16: a bf16 cache's keys are scored with vdpbf16ps against the query
// rounded to bf16 (as the bf16 linear layers round their input). Chosen only when the running CPU
// reports AVX512-BF16 and the op's isa bits allow it.
#include <immintrin.h>

#include <type_traits>
#include <utility>

#include "kernel_set.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx2,fma")
namespace bs {
namespace avx512_bf16 {
#define BS_BF16_DOT 1
#include "unroll.h"  // with_rows: score_span_in_lanes' row blocks
#include "simd_avx512.h"
#include "kernel_impl.h"
#undef BS_BF16_DOT
}  // namespace avx512_bf16
}  // namespace bs
#pragma GCC pop_options

// Outside the region: called from baseline code.
const bs::KernelSet& bs::avx512_bf16_kernels() { return avx512_bf16::kKernels; }
