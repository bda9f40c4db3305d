// The kernels of one instruction set, written once over `Vec` (simd_avx2.h or simd_avx512.h) and split by job.
// Included by kernels_avx2.cc, kernels_avx512.cc and kernels_avx512_bf16.cc inside their `#pragma GCC target`
// regions and namespaces; no include guard on purpose. Only builtins and own code here and in the headers it
// includes: an inline library function instantiated in this region would be compiled for the region's ISA.

using reg = Vec::reg;
constexpr int W = Vec::W;

#include "vector_exp.h"  // vexp, silu_times

static inline float sexp(float x) { return __builtin_expf(x); }

#include "elementwise_kernels.h"   // rms_norm_row, silu_and_mul_row
#include "sampling_kernels.h"      // argmax_row, draw_masses
#include "rope_kernels.h"          // rotate_head, the cache writes
// The attention, in this order: GCC allocates registers in the bf16 decode tiles' value sums as it did in one file
// only with the vdpbf16ps micro-kernels defined before attention_span.h's (after them, it kept their 18
// accumulators on the stack).
#include "attention_bf16_dot.h"    // vdpbf16ps scores and values, for a bf16 cache (BS_BF16_DOT)
#include "attention_span.h"        // scores, softmax and values of one span
#include "attention_prefetch.h"    // what a tile asks for as it computes
#include "attention_tile.h"        // attend_tile

static const KernelSet kKernels = {rms_norm_row, silu_and_mul_row, rotate_head, rotate_head_bf16, store_bf16,
                                   attend_tile,  attend_tile_bf16, argmax_row,  draw_masses};
