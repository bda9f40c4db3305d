// The packed-weight GEMM for BF16 weights on AVX512-BF16: vdpbf16ps sums the products of bf16 pairs in
// fp32; x is rounded to bf16 (nearest even) once per call. Included inside the avx512_bf16 region of
// linear_gemm.cc after unroll.h; no include guard, nothing from the standard library.
//
// x is prepared as 32-bit words, one per block of W (a bf16 pair), so that one broadcast word times one
// 64-byte block of a panel feeds all 16 columns.

constexpr int kMaxRows = 12;  // 12 rows x 2 panels: 24 accumulators of the 32 zmm
// From this many rows of x a tile takes two panels: 24 independent sums per word instead of 12 (the 4 GEMMs of the
// default model at 512 rows: 8.7 ms with two panels, 10.8 with one, AMD EPYC Zen 4). Fewer rows wait on memory,
// where one panel per tile measured faster.
constexpr int64_t kTwoPanelRows = 16;

#include "bf16_pairs.h"  // to_bf16_pairs: x as 32-bit words, one per block of W; dot_broadcast
#include "simd_avx512.h"  // Vec, for vector_exp.h
using reg = Vec::reg;
#include "vector_exp.h"  // silu_times: the fused SiLU-and-multiply computes what silu_and_mul_row does

// Rows of x (num_words words each) a block holds: whole tiles, at least one, within kBlockBytes.
static inline int64_t rows_per_block(int64_t num_words) {
  const int64_t fitting_rows = kBlockBytes / (num_words * 4) / kMaxRows * kMaxRows;
  return fitting_rows > kMaxRows ? fitting_rows : kMaxRows;
}

// y[rows, kPanels panels] = start + the rows' words . the panels' blocks: one broadcast word feeds every
// panel's block, and every panel but the last has all 16 columns (`cols` of the last). `ahead` (or null): the
// next tile's kPanels panels, asked for a line each per word (asks_ahead).
// kSiluMul (two panels: a gate panel, then the up panel of the same 16 features): y[rows, 16] = silu(gate) * up
// instead, as silu_and_mul_row computes it from the two products.
template <int kRows, int kPanels, bool kSiluMul = false>
static inline __attribute__((flatten)) void tile(const uint32_t* words, int64_t num_words, const uint8_t* panel,
                                                 int64_t panel_bytes, const float* start, float* y, int64_t ldy,
                                                 int cols, const uint8_t* ahead) {
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
    const __mmask16 columns = p + 1 < kPanels ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << cols) - 1);
    const __m512 bias = _mm512_maskz_loadu_ps(columns, start + p * kPanelWidth);
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
      for (int s = 1; s < kSplit; ++s) acc[0][p][r] = _mm512_add_ps(acc[0][p][r], acc[s][p][r]);
      _mm512_mask_storeu_ps(y + r * ldy + p * kPanelWidth, columns, _mm512_add_ps(acc[0][p][r], bias));
    }
  }
}

// y[m, n] = x[m, k] @ W (+ bias); `words` (m * num_blocks(k) of them) is scratch.
static void gemm(const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, const float* bias, float* y,
                 uint32_t* words) {
  const int64_t panels = num_panels(n), bytes = panel_bytes(Format::kBF16, k);
  const int64_t num_words = num_blocks(Format::kBF16, k);
  const int64_t block_rows = rows_per_block(num_words);
  const bool rows_in_parallel = m > kMaxRows;  // a tile's worth of rows is prepared faster than a barrier
  const int64_t group_panels = m >= kTwoPanelRows ? 2 : 1;
  if (!rows_in_parallel) {
    for (int64_t r = 0; r < m; ++r) to_bf16_pairs(x + r * k, k, words + r * num_words);
  }
#pragma omp parallel
  {
    if (rows_in_parallel) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < m; ++r) to_bf16_pairs(x + r * k, k, words + r * num_words);
    }
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
      const int64_t m_end = m < m0 + block_rows ? m : m0 + block_rows;
      for_each_panel((panels + group_panels - 1) / group_panels, !rows_in_parallel, [&](int64_t group) {
        const int64_t p = group * group_panels, tile_panels = panels - p < group_panels ? panels - p : group_panels;
        const int64_t remaining = n - p * kPanelWidth;
        const int64_t tile_cols = remaining < tile_panels * kPanelWidth ? remaining : tile_panels * kPanelWidth;
        const int cols = static_cast<int>(tile_cols - (tile_panels - 1) * kPanelWidth);  // of the last panel
        float start[2 * kPanelWidth] = {};
        if (bias != nullptr) __builtin_memcpy(start, bias + p * kPanelWidth, tile_cols * sizeof(float));
        for_each_row_tile<kMaxRows>(m0, m_end, [&](int64_t r0, int tile_rows) {
          with_rows<kMaxRows>(tile_rows, [&](auto rows) {
            constexpr int kRows = decltype(rows)::value;
            const uint32_t* row_words = words + r0 * num_words;
            float* out = y + r0 * n + p * kPanelWidth;
            const bool next_whole = p + tile_panels + group_panels <= panels;  // the next tile's panels
            const uint8_t* ahead =
                asks_ahead(m, r0) && next_whole ? packed + (p + tile_panels) * bytes : nullptr;
            if (tile_panels == 2) {
              tile<kRows, 2>(row_words, num_words, packed + p * bytes, bytes, start, out, n, cols, ahead);
            } else {
              tile<kRows, 1>(row_words, num_words, packed + p * bytes, bytes, start, out, n, cols, ahead);
            }
          });
        });
      });
    }
  }
}

// out[m, n / 2] = silu(x @ W[:, :n / 2]) * (x @ W[:, n / 2:]) for a gate|up weight without bias (n / 2 a multiple of
// 16, m >= kTwoPanelRows): each tile pairs gate panel g with up panel n / 32 + g and applies silu_and_mul_row's
// arithmetic to its accumulators, so the [m, n] product is never written and read back. `words` is scratch.
static void gemm_silu_and_mul(const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, float* out,
                              uint32_t* words) {
  const int64_t half = n / 2, half_panels = half / kPanelWidth, bytes = panel_bytes(Format::kBF16, k);
  const int64_t num_words = num_blocks(Format::kBF16, k);
  const int64_t block_rows = rows_per_block(num_words);
  const float no_bias[2 * kPanelWidth] = {};
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) to_bf16_pairs(x + r * k, k, words + r * num_words);
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
      const int64_t m_end = m < m0 + block_rows ? m : m0 + block_rows;
#pragma omp for schedule(static) nowait
      for (int64_t g = 0; g < half_panels; ++g) {
        for_each_row_tile<kMaxRows>(m0, m_end, [&](int64_t r0, int tile_rows) {
          with_rows<kMaxRows>(tile_rows, [&](auto rows) {
            constexpr int kRows = decltype(rows)::value;
            const uint8_t* ahead =
                asks_ahead(m, r0) && g + 1 < half_panels ? packed + (g + 1) * bytes : nullptr;
            tile<kRows, 2, true>(words + r0 * num_words, num_words, packed + g * bytes, half_panels * bytes, no_bias,
                                 out + r0 * half + g * kPanelWidth, half, kPanelWidth, ahead);
          });
        });
      }
    }
  }
}
