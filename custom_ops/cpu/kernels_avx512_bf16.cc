// The AVX-512 kernels with AVX512-BF16 and AVX512-VNNI: a bf16 cache's keys are scored with vdpbf16ps against the
// query rounded to bf16 (as the bf16 linear layers round their input), an int8 cache's with vpdpbusd against the
// query quantized to int8 (as the int8 linear layers quantize theirs). Chosen only when the running CPU reports both
// (every CPU with AVX512-BF16 has AVX512-VNNI and AVX512BW) and the op's isa bits allow them.
#include <immintrin.h>

#include <type_traits>
#include <utility>

#include "kernel_set.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx512vnni,avx2,fma")
namespace bs {
namespace avx512_bf16 {
#define BS_BF16_DOT 1
#define BS_INT8_DOT 1
#include "unroll.h"  // with_rows: score_span_in_lanes' row blocks
#include "simd_avx512.h"
#include "kernel_impl.h"
#undef BS_BF16_DOT
#undef BS_INT8_DOT
}  // namespace avx512_bf16
}  // namespace bs
#pragma GCC pop_options

// Outside the region: called from baseline code.
const bs::KernelSet& bs::avx512_bf16_kernels() { return avx512_bf16::kKernels; }
