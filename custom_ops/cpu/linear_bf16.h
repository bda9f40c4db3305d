// The GEMM micro-kernel for BF16 weights on AVX512-BF16: vdpbf16ps sums the products of bf16 pairs in
// fp32; x is rounded to bf16 (nearest even) once per call. Included inside the avx512_bf16 region of
// linear_gemm.cc after unroll.h; no include guard, nothing from the standard library.
//
// x is prepared as 32-bit words, one per block of W (a bf16 pair), so that one broadcast word times one
// 64-byte block of a panel feeds all 16 columns.

#include "bf16_pairs.h"  // to_bf16_pairs: x as 32-bit words, one per block of W; dot_broadcast
#include "simd_avx512.h"  // Vec, for vector_exp.h
using reg = Vec::reg;
#include "vector_exp.h"  // silu_times: the fused SiLU-and-multiply computes what silu_and_mul_row does

// The micro-kernel (gemm_driver.h) of the formats whose blocks are bf16 pairs (FormatTraits::kDot == Dot::kBf16).
template <Format kFormat>
struct Bf16DotKernel {
  static constexpr bool kReads = FormatTraits<kFormat>::kDot == Dot::kBf16;
  static constexpr int kTileRows = 12;  // 12 rows x 2 panels: 24 accumulators of the 32 zmm
  static constexpr bool kEvenRowTiles = true;
  static constexpr int kMaxPanels = 2;
  // From this many rows of x a tile takes two panels: 24 independent sums per word instead of 12 (the 4 GEMMs of
  // the default model at 512 rows: 8.7 ms with two panels, 10.8 with one, AMD EPYC Zen 4). Fewer rows wait on
  // memory, where one panel per tile measured faster.
  static constexpr int64_t kTwoPanelRows = 16;

  static ScratchSize scratch(int64_t m, int64_t k) { return {m * num_blocks(kFormat, k), 0}; }

  // Rows of x as words (num_words each) from a tile's first.
  struct Rows {
    const uint32_t* words;
    int64_t num_words;
  };
  struct Input {
    static constexpr bool kPrepares = true;
    const float* x;
    int64_t k;
    uint32_t* words;
    int64_t num_words;
    Input(const float* x, int64_t, int64_t k, const Scratch& scratch)
        : x(x), k(k), words(scratch.words), num_words(num_blocks(kFormat, k)) {}
    void prepare(int64_t r) const { to_bf16_pairs(x + r * k, k, words + r * num_words); }
    Rows rows(int64_t r0) const { return {words + r0 * num_words, num_words}; }
    int64_t row_bytes() const { return num_words * 4; }
  };

  // y[rows, kPanels panels] = start + the rows' words . the panels' blocks: one broadcast word feeds every
  // panel's block, and every panel but the last has all 16 columns (`cols` of the last). `ahead` (or null): the
  // next tile's kPanels panels, asked for a line each per word (asks_ahead; never below kAskingRows rows, so never
  // non-temporally).
  // kSiluMul (two panels: a gate panel, then the up panel of the same 16 features): y[rows, 16] = silu(gate) * up
  // instead, as silu_and_mul_row computes it from the two products.
  template <int kRows, int kPanels, bool kSiluMul>
  static inline __attribute__((flatten)) void tile(Rows rows, const uint8_t* panel, int64_t panel_bytes,
                                                   const float* start, float* y, int64_t ldy, int cols,
                                                   const uint8_t* ahead, bool) {
    const uint32_t* words = rows.words;
    const int64_t num_words = rows.num_words;
    static_assert(!kSiluMul || kPanels == 2, "a SiLU tile pairs a gate panel with an up panel");
    constexpr int kSplit = kRows * kPanels >= 8 ? 1 : 8 / (kRows * kPanels);  // sums to cover the latency
    // Every loop over acc is unrolled whole: one run-time index into it keeps acc in memory, and GCC then stores
    // every accumulator after each dot_broadcast (the SiLU tiles, whose epilogue loops were not unrolled, ran
    // 2.3x slower in a prefill step).
    __m512 acc[kSplit][kPanels][kRows];
#pragma GCC unroll 8
    for (int s = 0; s < kSplit; ++s) {
#pragma GCC unroll 2
      for (int p = 0; p < kPanels; ++p) {
#pragma GCC unroll 16
        for (int r = 0; r < kRows; ++r) acc[s][p][r] = _mm512_setzero_ps();
      }
    }
    int64_t w = 0;
    for (; w + kSplit <= num_words; w += kSplit) {
      if (ahead != nullptr) {
        for (int p = 0; p < kPanels; ++p) {
          for (int s = 0; s < kSplit; ++s) __builtin_prefetch(ahead + p * panel_bytes + (w + s) * 64, 0, 2);
        }
      }
      static_for<kSplit>([&](auto s) {
        __m512bh weights[kPanels];
        for (int p = 0; p < kPanels; ++p) {
          weights[p] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * panel_bytes + (w + s) * 64));
        }
#pragma GCC unroll 16
        for (int r = 0; r < kRows; ++r) {
          for (int p = 0; p < kPanels; ++p) {
            acc[s][p][r] = dot_broadcast(acc[s][p][r], weights[p], &words[r * num_words + w + s]);
          }
        }
      });
    }
    for (; w < num_words; ++w) {
#pragma GCC unroll 2
      for (int p = 0; p < kPanels; ++p) {
        const __m512bh weights = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * panel_bytes + w * 64));
#pragma GCC unroll 16
        for (int r = 0; r < kRows; ++r) {
          const __m512i pair = _mm512_set1_epi32(static_cast<int>(words[r * num_words + w]));
          acc[0][p][r] = _mm512_dpbf16_ps(acc[0][p][r], reinterpret_cast<__m512bh>(pair), weights);
        }
      }
    }
    if constexpr (kSiluMul) {
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
        for (int s = 1; s < kSplit; ++s) {
          acc[0][0][r] = _mm512_add_ps(acc[0][0][r], acc[s][0][r]);
          acc[0][1][r] = _mm512_add_ps(acc[0][1][r], acc[s][1][r]);
        }
        const __m512 gate = _mm512_add_ps(acc[0][0][r], _mm512_loadu_ps(start));
        const __m512 up = _mm512_add_ps(acc[0][1][r], _mm512_loadu_ps(start + kPanelWidth));
        _mm512_storeu_ps(y + r * ldy, silu_times(gate, up));
      }
      return;
    }
#pragma GCC unroll 2
    for (int p = 0; p < kPanels; ++p) {
      const __mmask16 columns =
          p + 1 < kPanels ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << cols) - 1);
      const __m512 bias = _mm512_maskz_loadu_ps(columns, start + p * kPanelWidth);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
        for (int s = 1; s < kSplit; ++s) acc[0][p][r] = _mm512_add_ps(acc[0][p][r], acc[s][p][r]);
        _mm512_mask_storeu_ps(y + r * ldy + p * kPanelWidth, columns, _mm512_add_ps(acc[0][p][r], bias));
      }
    }
  }
};
