// The AVX512-BF16 kernels with AMX-BF16: a bf16 cache's prefill spans (one-head tiles of several queries) are
// scored and their values summed by tdpbf16ps on tiles (attention_amx.h); everything else is
// kernels_avx512_bf16.cc's code (an int8 cache's keys by vpdpbusd included). Chosen only when the running CPU has
// AMX, Linux grants this process its tiles, and the op's isa bits allow it (isa.h).
#include <immintrin.h>

#include <type_traits>
#include <utility>

#include "kernel_set.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx512vnni,amx-tile,amx-bf16,avx2,fma")
namespace bs {
namespace amx_attention {
#define BS_BF16_DOT 1
#define BS_INT8_DOT 1
#define BS_AMX_ATTENTION 1
#include "unroll.h"  // with_rows: score_span_in_lanes' row blocks
#include "simd_avx512.h"
#include "kernel_impl.h"
#undef BS_AMX_ATTENTION
#undef BS_INT8_DOT
#undef BS_BF16_DOT
}  // namespace amx_attention
}  // namespace bs
#pragma GCC pop_options

// Outside the region: called from baseline code.
const bs::KernelSet& bs::amx_kernels() { return amx_attention::kKernels; }
