#include "linear_gemm.h"

#include <immintrin.h>

#include <type_traits>
#include <utility>
#include <vector>

namespace bs::linear {
namespace {

// Bytes of x rows a block holds: with the current weight panel (up to 96 KiB at depth 1536; the bf16
// GEMM's two panels of 16 rows and more, 2 x 48 KiB) it stays in a 512 KiB L2.
constexpr int64_t kBlockBytes = 256 << 10;

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
typedef float Vec __attribute__((vector_size(32)));
constexpr int kMaxRows = 6;  // 12 accumulators + 2 weight registers of the 16 ymm
static inline Vec load_halves(const uint8_t* from) {
  return reinterpret_cast<Vec>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from))));
}
#include "unroll.h"
#include "linear_tile.h"
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
#include "unroll.h"
#include "linear_tile.h"
#pragma GCC pop_options
}  // namespace avx512

namespace avx512_bf16 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx2,fma,f16c")
#include "unroll.h"
#include "linear_bf16.h"
#pragma GCC pop_options
}  // namespace avx512_bf16

namespace avx512_vnni {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni,avx2,fma,f16c")
#include "unroll.h"
#include "linear_vnni.h"
#pragma GCC pop_options
}  // namespace avx512_vnni

}  // namespace

bool gemm_silu_and_mul(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed,
                       int64_t n, const float* bias, float* out) {
  if (format != Format::kBF16 || !isa.bf16 || bias != nullptr || m < avx512_bf16::kTwoPanelRows ||
      n % (2 * kPanelWidth) != 0) {
    return false;
  }
  std::vector<uint32_t> words(m * num_blocks(format, k));
  avx512_bf16::gemm_silu_and_mul(x, m, k, packed, n, out, words.data());
  return true;
}

void gemm(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n,
          const float* bias, float* y) {
  // Scratch for x prepared as words is allocated here: no library code is instantiated inside the ISA regions.
  const int64_t num_words = num_blocks(format, k) * (format == Format::kBF16 ? 1 : geometry(format).block_k / 4);
  if (format == Format::kBF16 && isa.bf16) {
    std::vector<uint32_t> words(m * num_words);
    avx512_bf16::gemm(x, m, k, packed, n, bias, y, words.data());
  } else if (isa.vnni && format != Format::kF32 && format != Format::kBF16) {
    const int64_t num_groups = (num_words + 7) / 8;
    std::vector<uint32_t> words(m * num_words);
    std::vector<float> scales(m * num_groups), scaled_sums(m * num_groups);
    avx512_vnni::gemm(format, x, m, k, packed, n, bias, y, words.data(), scales.data(), scaled_sums.data());
  } else if (isa.avx512) {
    avx512::gemm(format, x, m, k, packed, n, bias, y);
  } else {
    avx2::gemm(format, x, m, k, packed, n, bias, y);
  }
}

}  // namespace bs::linear
