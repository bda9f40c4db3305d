// The kernels of one instruction set, written once over `Vec` (simd_avx2.h or simd_avx512.h) and split by job.
// Included by kernels_avx2.cc, kernels_avx512.cc, kernels_avx512_bf16.cc and kernels_amx.cc inside their
// `#pragma GCC target` regions and namespaces; no include guard on purpose. Only builtins and own code here and in
// the headers it includes: an inline library function instantiated in this region would be compiled for the region's
// ISA.

using reg = Vec::reg;
constexpr int W = Vec::W;

#include "vector_exp.h"  // vexp, silu_times
#include "kv_element.h"  // KvElement<T>: the cache element types' loads, stores and rounding

static inline float sexp(float x) { return __builtin_expf(x); }

#include "elementwise_kernels.h"   // rms_norm_row, silu_and_mul_row
#include "sampling_kernels.h"      // argmax_row, draw_masses
#include "rope_kernels.h"          // rotate_head_to, store_row
// The attention, in this order: GCC allocates registers in the bf16 decode tiles' value sums as it did in one file
// only with the vdpbf16ps micro-kernels defined before attention_span.h's (after them, it kept their 18
// accumulators on the stack).
#include "attention_bf16_dot.h"    // vdpbf16ps scores and values, for a bf16 cache (BS_BF16_DOT)
#include "attention_int8_dot.h"    // vpdpbusd scores, for an int8 cache (BS_INT8_DOT)
#include "attention_span.h"        // scores, softmax and values of one span
#include "attention_prefetch.h"    // what a tile asks for as it computes
#include "attention_int8_groups.h" // a tile over an int8 cache in groups (BS_INT8_DOT)
#include "attention_amx.h"         // a prefill span on AMX tiles, for a bf16 cache (BS_AMX_ATTENTION)
#include "attention_tile.h"        // attend_tile

// The cache kernels of every element type of the list.
template <class... Ts>
static constexpr KvKernelsOf<TypeList<Ts...>> kv_kernels(TypeList<Ts...>) {
  return {KvKernels<Ts>{rotate_head_to<Ts>, store_row<Ts>, attend_tile<Ts>}...};
}

#ifdef BS_INT8_DOT
static const KernelSet kKernels = {rms_norm_row, silu_and_mul_row, rotate_head_to<float>, argmax_row, draw_masses,
                                   kv_kernels(KvElementTypes{}), write_int8_groups};
#else
static const KernelSet kKernels = {rms_norm_row, silu_and_mul_row, rotate_head_to<float>, argmax_row, draw_masses,
                                   kv_kernels(KvElementTypes{}), nullptr};
#endif
