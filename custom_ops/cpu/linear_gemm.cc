#include "linear_gemm.h"

#include <immintrin.h>

#include <type_traits>
#include <utility>
#include <vector>

namespace bs::linear {
namespace {

// Bytes of x rows a block holds: with the current weight panel (up to 96 KiB at depth 1536) it stays
// in a 512 KiB L2.
constexpr int64_t kBlockBytes = 256 << 10;

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
typedef float Vec __attribute__((vector_size(32)));
constexpr int kMaxRows = 6;  // 12 accumulators + 2 weight registers of the 16 ymm
static inline Vec load_halves(const uint8_t* from) {
  return reinterpret_cast<Vec>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from))));
}
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
#include "linear_tile.h"
#pragma GCC pop_options
}  // namespace avx512

namespace avx512_bf16 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx2,fma,f16c")
// BF16 weights: fp32 sums of bf16 products, x rounded to bf16 (nearest even) once per call.
struct Dot {
  static constexpr Format kFormat = Format::kBF16;
  typedef __m512 Acc;
  static inline Acc zero() { return _mm512_setzero_ps(); }
  static inline Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static inline Acc dot(Acc acc, __m512i weights, __m512i x) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(x), reinterpret_cast<__m512bh>(weights));
  }
  static inline __m512 finish(const uint8_t*, Acc acc, float) { return acc; }
  // words[i] = bf16(x[2i]) | bf16(x[2i + 1]) << 16, the last one zero-padded.
  static inline void prepare_row(const float* x, int64_t k, uint32_t* words, float*) {
    for (int64_t i = 0; i < k; i += 32) {
      const int64_t rest = k - i;
      const __mmask16 low = rest >= 16 ? 0xffff : static_cast<__mmask16>((1u << rest) - 1);
      const __mmask16 high = rest >= 32 ? 0xffff : rest <= 16 ? 0 : static_cast<__mmask16>((1u << (rest - 16)) - 1);
      const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, x + i + 16), _mm512_maskz_loadu_ps(low, x + i));
      const int64_t num_words = rest >= 32 ? 16 : (rest + 1) / 2;
      _mm512_mask_storeu_epi32(words + i / 2, static_cast<__mmask16>((1u << num_words) - 1), reinterpret_cast<__m512i>(pairs));
    }
  }
};
#include "linear_dot.h"
#pragma GCC pop_options
}  // namespace avx512_bf16

namespace avx512_vnni {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni,avx2,fma,f16c")
// INT8 weights times x quantized per row: q = rint(x * 127 / max|x|), stored as q + 128 (u8), so
// sum((q + 128) * w) - 128 * column_sum(w) = sum(q * w) exactly in int32.
struct Dot {
  static constexpr Format kFormat = Format::kInt8;
  typedef __m512i Acc;
  static inline Acc zero() { return _mm512_setzero_si512(); }
  static inline Acc add(Acc a, Acc b) { return _mm512_add_epi32(a, b); }
  static inline Acc dot(Acc acc, __m512i weights, __m512i x) { return _mm512_dpbusd_epi32(acc, x, weights); }
  static inline __m512 finish(const uint8_t* panel, Acc acc, float row_scale) {
    const __m512i column_sums = _mm512_loadu_si512(panel + 64);
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_slli_epi32(column_sums, 7)));
    return _mm512_mul_ps(_mm512_mul_ps(sums, _mm512_loadu_ps(panel)), _mm512_set1_ps(row_scale));
  }
  static inline void prepare_row(const float* x, int64_t k, uint32_t* words, float* row_scale) {
    __m512 max_abs = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 valid = k - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (k - i)) - 1);
      max_abs = _mm512_max_ps(max_abs, _mm512_abs_ps(_mm512_maskz_loadu_ps(valid, x + i)));
    }
    const float amax = _mm512_reduce_max_ps(max_abs);
    *row_scale = amax / 127.0f;
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    uint8_t* bytes = reinterpret_cast<uint8_t*>(words);
    const int64_t padded = (k + 3) / 4 * 4;
    for (int64_t i = 0; i < padded; i += 16) {
      const __mmask16 valid = k - i >= 16 ? 0xffff : k <= i ? 0 : static_cast<__mmask16>((1u << (k - i)) - 1);
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(valid, x + i), inverse));
      const __m128i shifted = _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128)));
      __builtin_memcpy(bytes + i, &shifted, padded - i >= 16 ? 16 : padded - i);
    }
  }
};
#include "linear_dot.h"
#pragma GCC pop_options
}  // namespace avx512_vnni

}  // namespace

void gemm(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n,
          const float* bias, float* y) {
  if ((format == Format::kBF16 && isa.bf16) || (format == Format::kInt8 && isa.vnni)) {
    // Scratch for x as words, allocated here: no library code is instantiated inside the ISA regions.
    std::vector<uint32_t> words(m * num_blocks(format, k));
    std::vector<float> row_scales(m);
    if (format == Format::kBF16) {
      avx512_bf16::gemm(x, m, k, packed, n, bias, y, words.data(), row_scales.data());
    } else {
      avx512_vnni::gemm(x, m, k, packed, n, bias, y, words.data(), row_scales.data());
    }
  } else if (isa.avx512) {
    avx512::gemm(format, x, m, k, packed, n, bias, y);
  } else {
    avx2::gemm(format, x, m, k, packed, n, bias, y);
  }
}

}  // namespace bs::linear
