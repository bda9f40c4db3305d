// The packed-weight GEMM on AVX-512 dot-product instructions: BF16 weights with vdpbf16ps (x rounded to
// bf16, fp32 sums) and INT8 weights with vpdpbusd (x quantized per row to 8 bits, int32 sums). Included
// inside a `#pragma GCC target` region of linear_gemm.cc that defines `Dot` (one of the policies at the
// end of linear_gemm.cc); no include guard, no includes, nothing from the standard library.
//
// x is prepared once per call into 32-bit words, one per block of W (a bf16 pair or four bytes), so that
// one broadcast word times one 64-byte block of a panel feeds all 16 columns.

constexpr int kMaxRows = 12;  // 12 accumulators of the 32 zmm
typedef typename Dot::Acc Acc;

template <int kIndex>
using Index = std::integral_constant<int, kIndex>;

template <class F, int... kIndices>
static inline __attribute__((always_inline)) void unrolled(F&& f, std::integer_sequence<int, kIndices...>) {
  (f(Index<kIndices>{}), ...);
}
template <int N, class F>
static inline __attribute__((always_inline)) void static_for(F&& f) {
  unrolled(f, std::make_integer_sequence<int, N>{});
}

// y[rows, 0:cols] = start + the rows' words . the panel's blocks (then Dot::finish's scaling).
template <int kRows>
static inline __attribute__((flatten)) void dot_tile(const uint32_t* words, int64_t num_words, const float* row_scales,
                            const uint8_t* panel, const float* start, float* y, int64_t ldy, int cols) {
  constexpr int kSplit = kRows >= 8 ? 1 : 8 / kRows;  // independent sums to cover the instruction latency
  Acc acc[kSplit][kRows];
  for (int s = 0; s < kSplit; ++s) {
    for (int r = 0; r < kRows; ++r) acc[s][r] = Dot::zero();
  }
  const uint8_t* blocks = panel + geometry(Dot::kFormat).header_bytes;
  int64_t w = 0;
  for (; w + kSplit <= num_words; w += kSplit) {
    static_for<kSplit>([&](auto s) {
      const __m512i weights = _mm512_loadu_si512(blocks + (w + s) * 64);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        acc[s][r] = Dot::dot(acc[s][r], weights, _mm512_set1_epi32(static_cast<int>(words[r * num_words + w + s])));
      }
    });
  }
  for (; w < num_words; ++w) {
    const __m512i weights = _mm512_loadu_si512(blocks + w * 64);
    for (int r = 0; r < kRows; ++r) {
      acc[0][r] = Dot::dot(acc[0][r], weights, _mm512_set1_epi32(static_cast<int>(words[r * num_words + w])));
    }
  }
  const __mmask16 columns = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 bias = _mm512_maskz_loadu_ps(columns, start);
  for (int r = 0; r < kRows; ++r) {
    for (int s = 1; s < kSplit; ++s) acc[0][r] = Dot::add(acc[0][r], acc[s][r]);
    _mm512_mask_storeu_ps(y + r * ldy, columns, _mm512_add_ps(Dot::finish(panel, acc[0][r], row_scales[r]), bias));
  }
}

template <int... kRows>
static inline void dot_tile_of(int rows, std::integer_sequence<int, kRows...>, const uint32_t* words,
                               int64_t num_words, const float* row_scales, const uint8_t* panel, const float* start,
                               float* y, int64_t ldy, int cols) {
  ((rows == kRows + 1 ? dot_tile<kRows + 1>(words, num_words, row_scales, panel, start, y, ldy, cols) : void()), ...);
}

// y[m, n] = x[m, k] @ W (+ bias). `words` (m * num_blocks(k) of them) and `row_scales` (m) are scratch.
static void gemm(const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, const float* bias, float* y,
                 uint32_t* words, float* row_scales) {
  const int64_t panels = num_panels(n), bytes = panel_bytes(Dot::kFormat, k);
  const int64_t num_words = num_blocks(Dot::kFormat, k);
  const int64_t fitting_rows = kBlockBytes / (num_words * 4) / kMaxRows * kMaxRows;
  const int64_t block_rows = fitting_rows > kMaxRows ? fitting_rows : kMaxRows;
  const bool rows_in_parallel = m > kMaxRows;  // a tile's worth of rows is prepared faster than a barrier
  if (!rows_in_parallel) {
    for (int64_t r = 0; r < m; ++r) Dot::prepare_row(x + r * k, k, words + r * num_words, row_scales + r);
  }
#pragma omp parallel
  {
    if (rows_in_parallel) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < m; ++r) Dot::prepare_row(x + r * k, k, words + r * num_words, row_scales + r);
    }
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
      const int64_t m_end = m < m0 + block_rows ? m : m0 + block_rows;
#pragma omp for schedule(static) nowait
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t remaining = n - p * kPanelWidth;
        const int cols = static_cast<int>(remaining < kPanelWidth ? remaining : kPanelWidth);
        float start[kPanelWidth] = {};
        if (bias != nullptr) __builtin_memcpy(start, bias + p * kPanelWidth, cols * sizeof(float));
        for (int64_t r0 = m0; r0 < m_end; r0 += kMaxRows) {
          const int rows = static_cast<int>(m_end - r0 < kMaxRows ? m_end - r0 : kMaxRows);
          dot_tile_of(rows, std::make_integer_sequence<int, kMaxRows>{}, words + r0 * num_words, num_words,
                      row_scales + r0, packed + p * bytes, start, y + r0 * n + p * kPanelWidth, n, cols);
        }
      }
    }
  }
}
