#include "linear_gemm.h"

#include "linear_onednn.h"

#include <immintrin.h>
#include <omp.h>

#include <iterator>
#include <type_traits>
#include <utility>
#include <vector>

namespace bs::linear {
namespace {

// Bytes of x rows a block holds: with the current weight panel (up to 96 KiB at depth 1536; the bf16
// GEMM's two panels of 16 rows and more, 2 x 48 KiB) it stays in a 512 KiB L2.
constexpr int64_t kBlockBytes = 256 << 10;

// One GEMM's operands: y[m, n] = x[m, k] @ W (+ bias, which may be null), W packed.
struct GemmCall {
  const float* x;
  int64_t m, k;
  const uint8_t* packed;
  int64_t n;
  const float* bias;
  float* y;
};

// What a micro-kernel prepares x in (x rounded to bf16 pairs, or quantized with scales per group), allocated here:
// no library code is instantiated inside the instruction-set regions.
struct ScratchSize {
  int64_t words, floats;
};
struct Scratch {
  uint32_t* words;
  float* floats;
};

// A region's entry points (gemm_driver.h's, over the formats its micro-kernel reads).
struct MicroKernelEntries {
  bool (*reads)(Format);
  ScratchSize (*scratch)(Format, int64_t m, int64_t k);
  void (*gemm)(Format, const GemmCall&, const Scratch&);
  bool (*fuses_silu_and_mul)(Format, int64_t m);
  void (*gemm_silu_and_mul)(Format, const GemmCall&, const Scratch&);
};

// One region per micro-kernel and instruction set: its header (the policy gemm_driver.h drives), the formats it
// serves as MicroKernel<format>, and gemm_driver.h for its entry points.
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
typedef float Vec __attribute__((vector_size(32)));
constexpr int kMaxRows = 6;  // 12 accumulators + 2 weight registers of the 16 ymm
static inline Vec load_halves(const uint8_t* from) {
  return reinterpret_cast<Vec>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from))));
}
static inline Vec fused_multiply_add(Vec a, Vec b, Vec c) {
  return reinterpret_cast<Vec>(
      _mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
}
#include "unroll.h"
#include "linear_tile.h"
template <Format kFormat>
using MicroKernel = WideningKernel<kFormat>;
#include "gemm_driver.h"
#pragma GCC pop_options
}  // namespace avx2

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
typedef float Vec __attribute__((vector_size(64)));
constexpr int kMaxRows = 12;  // 12 accumulators of the 32 zmm: one weight load feeds 12 FMAs
static inline Vec load_halves(const uint8_t* from) {
  return reinterpret_cast<Vec>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from))));
}
static inline Vec fused_multiply_add(Vec a, Vec b, Vec c) {
  return reinterpret_cast<Vec>(
      _mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
}
#include "unroll.h"
#include "linear_tile.h"
template <Format kFormat>
using MicroKernel = WideningKernel<kFormat>;
#include "gemm_driver.h"
#pragma GCC pop_options
}  // namespace avx512

namespace avx512_bf16 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx2,fma,f16c")
#include "unroll.h"
#include "linear_bf16.h"
template <Format kFormat>
using MicroKernel = Bf16DotKernel<kFormat>;
#include "gemm_driver.h"
#pragma GCC pop_options
}  // namespace avx512_bf16

namespace avx512_vnni {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni,avx2,fma,f16c")
#include "unroll.h"
#include "linear_vnni.h"
template <Format kFormat>
using MicroKernel = Int8DotKernel<kFormat>;
#include "gemm_driver.h"
#pragma GCC pop_options
}  // namespace avx512_vnni

namespace amx_bf16 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx512vnni,amx-tile,amx-bf16,amx-int8,avx2,fma,f16c")
#include "unroll.h"
#include "linear_bf16.h"
#include "linear_amx_bf16.h"
template <Format kFormat>
using MicroKernel = AmxBf16Kernel<kFormat>;
#include "gemm_driver.h"
#pragma GCC pop_options
}  // namespace amx_bf16

namespace amx_int8 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx512vnni,amx-tile,amx-bf16,amx-int8,avx2,fma,f16c")
#include "unroll.h"
#include "linear_vnni.h"
#include "simd_avx512.h"  // Vec, for vector_exp.h
using reg = Vec::reg;
#include "vector_exp.h"  // silu_times: the fused SiLU-and-multiply computes what silu_and_mul_row does
#include "linear_amx_int8.h"
template <Format kFormat>
using MicroKernel = AmxInt8Kernel<kFormat>;
#include "gemm_driver.h"
#pragma GCC pop_options
}  // namespace amx_int8

namespace amx_dequant {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vbmi,avx512bf16,avx512vnni,amx-tile,amx-bf16,amx-int8,avx2,fma,f16c")
#include "unroll.h"
#include "linear_vnni.h"
#include "linear_bf16.h"
#include "linear_amx_bf16.h"
#include "linear_amx_dequant.h"
template <Format kFormat>
using MicroKernel = AmxDequantKernel<kFormat>;
#include "gemm_driver.h"
#pragma GCC pop_options
}  // namespace amx_dequant

// A micro-kernel as the dispatch sees it: the instruction set it needs (null: every CPU the ops run on), the fewest
// rows of x it computes, and its region's entry points.
struct MicroKernelRow {
  bool Isa::*needs;
  int64_t min_rows;
  MicroKernelEntries entries;
};

// From this many rows of x a GEMM runs on AMX tiles (see kMicroKernels). bench_gemm.py --amx on an Intel Xeon
// (Emerald Rapids), 1 thread, a shared and busy host (ratios within +-30%): BF16 on tdpbf16ps 1.5-3.6x vdpbf16ps at 8
// rows, 3-7x from 32, but ~0.5-1x at 1 row; the int8 formats on tdpbsud 0.7-1.1x vpdpbusd at 8 rows, 1.1-2x from 16
// (their per-group scaling on AVX-512 bounds the gain), 0.3-0.6x at 1 row.
// From kAmxDequantMinRows rows the int8 formats' panels are dequantized to bf16 once per block of rows and run on
// tdpbf16ps (linear_amx_dequant.h). The 4 GEMMs of the default model's shapes (q|k|v, o, gate|up, down), random
// weights in each of the 4 formats, same host, 1 thread, a C++ loop over gemm() with this row's min_rows switched
// between runs, best of 25, dequantizing / tdpbsud: 1.6-1.7x at 16 rows, 0.90-1.01 at 32, 0.84-0.92 at 48, 0.69-0.75
// at 64, 0.61-0.64 at 512. 64, not 32 or 48: a clear gain, and fewer decode batches change kernels.
constexpr int64_t kAmxBf16MinRows = 8;
constexpr int64_t kAmxInt8MinRows = 16;
constexpr int64_t kAmxDequantMinRows = 64;

// The micro-kernels, fastest first: a GEMM runs on the first that the CPU and the op's isa bits allow, that reads
// the weight's format and takes its rows. AMX tiles from their fewest rows (tdpbf16ps for BF16; for INT8 and the GGUF
// blocks, tdpbf16ps on their panels dequantized to bf16 (x rounded to bf16) from kAmxDequantMinRows, tdpbsud below),
// vdpbf16ps for BF16 (x rounded to bf16), vpdpbusd for INT8 and the GGUF blocks (x quantized per 32 inputs to int8),
// else the weights widened to fp32 (x as it is).
const MicroKernelRow kMicroKernels[] = {
    {&Isa::amx, kAmxBf16MinRows, amx_bf16::entry::kEntries},
    {&Isa::amx, kAmxDequantMinRows, amx_dequant::entry::kEntries},
    {&Isa::amx, kAmxInt8MinRows, amx_int8::entry::kEntries},
    {&Isa::bf16, 0, avx512_bf16::entry::kEntries},
    {&Isa::vnni, 0, avx512_vnni::entry::kEntries},
    {&Isa::avx512, 0, avx512::entry::kEntries},
    {nullptr, 0, avx2::entry::kEntries},
};

const MicroKernelEntries& micro_kernel(const Isa& isa, Format format, int64_t m) {
  for (const MicroKernelRow& row : kMicroKernels) {
    if ((row.needs == nullptr || isa.*row.needs) && m >= row.min_rows && row.entries.reads(format)) return row.entries;
  }
  return kMicroKernels[std::size(kMicroKernels) - 1].entries;
}

// Scratch for x prepared as the micro-kernel reads it: two arrays, each from a 64-byte boundary, kept by the calling
// thread from one GEMM to the next and grown as needed (held until the thread ends: at most the largest GEMM's
// prepared x, a few MiB for a prompt chunk).
// - Aligned: an AMX tile loads 16 rows of 64 bytes, and a row that starts inside a cache line reads two. malloc
//   aligns a large vector to 16 bytes, and x's bf16 rows loaded from there made a 512 x 576 x 960 tile product
//   1.5x slower than from 64-byte aligned rows (one thread, Emerald Rapids).
// - Kept: a new scratch of a prompt chunk's size is fresh memory from the kernel each call (page faults, zeroing):
//   the bf16 GEMMs of 512 rows on AMX were 1.01-1.19x faster with a kept one (bench_gemm.py --amx).
// One GEMM at a time per thread: the MoE op's threads each call their own.
template <class T>
class AlignedArray {
 public:
  T* at_least(int64_t size) {
    constexpr int64_t kSlack = 64 / sizeof(T);
    if (static_cast<int64_t>(storage_.size()) < size + kSlack) storage_.resize(size + kSlack);
    const auto address = reinterpret_cast<uintptr_t>(storage_.data());
    return reinterpret_cast<T*>((address + 63) & ~static_cast<uintptr_t>(63));
  }

 private:
  std::vector<T> storage_;
};

static Scratch thread_scratch(const ScratchSize& size) {
  thread_local AlignedArray<uint32_t> words;
  thread_local AlignedArray<float> floats;
  return {words.at_least(size.words), floats.at_least(size.floats)};
}

}  // namespace

bool gemm_silu_and_mul(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed,
                       int64_t n, const float* bias, float* out) {
  const MicroKernelEntries& kernel = micro_kernel(isa, format, m);
  if (bias != nullptr || n % (2 * kPanelWidth) != 0 || !kernel.fuses_silu_and_mul(format, m)) return false;
  if (onednn_routes(isa, format, m, k)) return false;  // gemm takes it to oneDNN's matmul (no fused SiLU there)
  kernel.gemm_silu_and_mul(format, {x, m, k, packed, n, nullptr, out}, thread_scratch(kernel.scratch(format, m, k)));
  return true;
}

void gemm(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n,
          const float* bias, float* y) {
  if (onednn_gemm(isa, format, x, m, k, packed, n, bias, y)) return;
  const MicroKernelEntries& kernel = micro_kernel(isa, format, m);
  kernel.gemm(format, {x, m, k, packed, n, bias, y}, thread_scratch(kernel.scratch(format, m, k)));
}

}  // namespace bs::linear
