// The GEMM micro-kernel for the 8- and 4-bit formats (INT8, Q8_0, Q4_0, Q4_1) on AMX-INT8 for GEMMs of a few tiles of
// rows (from more rows, linear_amx_dequant.h dequantizes their panels to bf16 instead): x quantized per row and
// group of 32 inputs as for vpdpbusd (linear_vnni.h, whose Input and Group it shares), and each group's int32 sums
// taken by tdpbsud (signed bytes of x times the weights' unsigned bytes) in tiles, then scaled into fp32
// accumulators exactly as Int8DotKernel scales its vpdpbusd sums: the same int32 sums, the same fp32 operations in
// the same order, so the results are Int8DotKernel's bit for bit. Included inside the amx_int8 region of
// linear_gemm.cc after unroll.h and linear_vnni.h; no include guard, nothing from the standard library.
//
// A group's weights are 8 rows of 64 bytes (4 inputs by 16 columns, as vpdpbusd reads them), tdpbsud's B layout:
// INT8 and Q8_0 groups are loaded from the panel as they are; a Q4 group's nibbles are spread to bytes first, and
// so is an INT8 panel's short last group (depth not a multiple of 32, its missing rows zero).

#include "amx_tiles.h"

constexpr int kAmxRows = 2 * kTileRegisterRows;  // rows of x per tile call: an upper and a lower A tile

// Where group g of a panel's blocks keeps its 8 rows of weight bytes as they are, or null where they must be spread.
template <Format kFormat>
static inline const uint8_t* group_rows(const uint8_t* blocks, int64_t g, int64_t num_words) {
  if constexpr (kFormat == Format::kInt8) return (g + 1) * kGroupWords <= num_words ? blocks + g * kGroupWords * 64 : nullptr;
  if constexpr (kFormat == Format::kQ8_0) return blocks + g * FormatTraits<kFormat>::kGeometry.block_bytes + 32;
  return nullptr;
}

// y[rows, kPanels panels] = start + x's rows . the panels (Int8DotKernel::tile's contract, rows at run time; kSiluMul
// as Bf16DotKernel's). Tile registers: tmm0..3 a group's int32 sums of (upper | lower rows) x (panel 0 | 1),
// tmm(2 * half + panel); tmm4, tmm5 the group's words of the upper and lower rows; tmm6, tmm7 its weights of panel 0
// and 1, as the thread configured them for the GEMM (load_gemm_tiles: 16 rows of x each, however many are x's).
// Not inlined: one body for every row count.
template <Format kFormat, int kPanels, bool kSiluMul>
static __attribute__((noinline)) void amx_int8_tile(const typename Int8DotKernel<kFormat>::Rows& x, int rows,
                                                    const uint8_t* panel, int64_t panel_bytes, const float* start,
                                                    float* y, int64_t ldy, int cols, const uint8_t* ahead,
                                                    bool non_temporal) {
  constexpr Geometry kGeometry = FormatTraits<kFormat>::kGeometry;
  const int upper = rows < kTileRegisterRows ? rows : kTileRegisterRows, lower = rows - upper;
  const uint8_t* words = reinterpret_cast<const uint8_t*>(x.words);
  const int64_t x_stride = x.num_words * 4;
  alignas(64) float acc[kAmxRows][2 * kPanelWidth];
  // Two groups' sums and scales: group g + 1's tiles are issued before group g's sums are scaled, so that the tile
  // unit multiplies while the vector units scale (one group at a time, the scaling's instructions fill the reorder
  // buffer and the tiles of the next group wait behind them: measured ~1.1x of vpdpbusd).
  alignas(64) int32_t sums[2][kAmxRows][2 * kPanelWidth];
  __m512 d[2][kPanels], offset[2][kPanels];
  alignas(64) uint8_t spread[2][kGroupWords * 64];  // a group's weights spread to bytes, per panel
  constexpr int64_t kSumsStride = sizeof sums[0][0];
  for (int r = 0; r < rows; ++r) {
    for (int p = 0; p < kPanels; ++p) _mm512_store_ps(&acc[r][p * kPanelWidth], _mm512_setzero_ps());
  }
  // Group g's int32 sums into sums[g % 2], its scales into d[g % 2] and offset[g % 2].
  auto multiply_group = [&](int64_t g) {
    const int buffer = static_cast<int>(g % 2);
    if (ahead != nullptr) {
      constexpr int64_t kGroupBytes = kGeometry.block_bytes * (kGroup / kGeometry.block_k);
      for (int p = 0; p < kPanels; ++p) {
        const uint8_t* group = ahead + p * panel_bytes + kGeometry.header_bytes + g * kGroupBytes;
        if (non_temporal) {
          for (int64_t line = 0; line < kGroupBytes; line += 64) __builtin_prefetch(group + line, 0, 0);
        } else {
          for (int64_t line = 0; line < kGroupBytes; line += 64) __builtin_prefetch(group + line, 0, 2);
        }
      }
    }
    const uint8_t* weights[kPanels];
    for (int p = 0; p < kPanels; ++p) {
      const uint8_t* blocks = panel + p * panel_bytes + kGeometry.header_bytes;
      weights[p] = group_rows<kFormat>(blocks, g, x.num_words);
      if (weights[p] != nullptr) {
        Group<kFormat>::words(blocks, g, x.num_words, d[buffer][p], offset[buffer][p], [](auto, __m512i) {});
      } else {
        for (int w = 0; w < kGroupWords; ++w) _mm512_store_si512(spread[p] + w * 64, _mm512_setzero_si512());
        Group<kFormat>::words(blocks, g, x.num_words, d[buffer][p], offset[buffer][p], [&](auto w, __m512i bytes) {
          _mm512_store_si512(spread[p] + decltype(w)::value * 64, bytes);
        });
        weights[p] = spread[p];
      }
    }
    int32_t(*into)[2 * kPanelWidth] = sums[buffer];
    BS_TILE_ZERO(0);
    if (kPanels == 2) BS_TILE_ZERO(1);
    if (lower > 0) {
      BS_TILE_ZERO(2);
      if (kPanels == 2) BS_TILE_ZERO(3);
    }
    BS_TILE_LOAD(6, weights[0], 64);
    if (kPanels == 2) BS_TILE_LOAD(7, weights[kPanels - 1], 64);
    BS_TILE_LOAD(4, words + g * kGroupWords * 4, x_stride);
    BS_TILE_DPBSUD(0, 4, 6);
    if (kPanels == 2) BS_TILE_DPBSUD(1, 4, 7);
    if (lower > 0) {
      BS_TILE_LOAD(5, words + kTileRegisterRows * x_stride + g * kGroupWords * 4, x_stride);
      BS_TILE_DPBSUD(2, 5, 6);
      if (kPanels == 2) BS_TILE_DPBSUD(3, 5, 7);
    }
    BS_TILE_STORE(0, &into[0][0], kSumsStride);
    if (kPanels == 2) BS_TILE_STORE(1, &into[0][kPanelWidth], kSumsStride);
    if (lower > 0) {
      BS_TILE_STORE(2, &into[kTileRegisterRows][0], kSumsStride);
      if (kPanels == 2) BS_TILE_STORE(3, &into[kTileRegisterRows][kPanelWidth], kSumsStride);
    }
  };
  multiply_group(0);
  for (int64_t g = 0; g < x.num_groups; ++g) {
    if (g + 1 < x.num_groups) multiply_group(g + 1);
    const int buffer = static_cast<int>(g % 2);
    for (int r = 0; r < rows; ++r) {  // Int8DotKernel's scaling of a group's sums
      const __m512 row_scale = _mm512_set1_ps(x.scales[r * x.num_groups + g]);
      const __m512 row_sum = _mm512_set1_ps(x.scaled_sums[r * x.num_groups + g]);
      for (int p = 0; p < kPanels; ++p) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(&sums[buffer][r][p * kPanelWidth]));
        __m512 a = _mm512_load_ps(&acc[r][p * kPanelWidth]);
        a = _mm512_fmadd_ps(_mm512_mul_ps(d[buffer][p], row_scale), sum, a);
        a = _mm512_fmadd_ps(offset[buffer][p], row_sum, a);
        _mm512_store_ps(&acc[r][p * kPanelWidth], a);
      }
    }
  }
  const __mmask16 last_columns = static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < rows; ++r) {
    __m512 out[kPanels];
    for (int p = 0; p < kPanels; ++p) {
      out[p] = _mm512_load_ps(&acc[r][p * kPanelWidth]);
      if (kFormat == Format::kInt8) out[p] = _mm512_mul_ps(out[p], _mm512_loadu_ps(panel + p * panel_bytes));
    }
    if constexpr (kSiluMul) {
      const __m512 gate = _mm512_add_ps(out[0], _mm512_loadu_ps(start));
      const __m512 up = _mm512_add_ps(out[1], _mm512_loadu_ps(start + kPanelWidth));
      _mm512_storeu_ps(y + r * ldy, silu_times(gate, up));
    } else {
      for (int p = 0; p < kPanels; ++p) {
        const __mmask16 columns = p + 1 < kPanels ? static_cast<__mmask16>(0xffff) : last_columns;
        const __m512 bias = _mm512_maskz_loadu_ps(columns, start + p * kPanelWidth);
        _mm512_mask_storeu_ps(y + r * ldy + p * kPanelWidth, columns, _mm512_add_ps(out[p], bias));
      }
    }
  }
}

// The micro-kernel (gemm_driver.h) of the int8 formats on AMX: Int8DotKernel's prepared x, kAmxRows rows by two
// panels per tile.
template <Format kFormat>
struct AmxInt8Kernel {
  using DotKernel = Int8DotKernel<kFormat>;
  static constexpr bool kReads = DotKernel::kReads;
  static constexpr int kTileRows = kAmxRows;
  static constexpr bool kEvenRowTiles = false;
  static constexpr int kMaxPanels = 2;
  static constexpr int64_t kTwoPanelRows = 1;

  // Int8DotKernel's words, and kAmxRows rows of slack: a tile loads 16 (or 32) rows of x however many are left (an
  // INT8 panel's short last group loads a whole group of each row, the words past the row times zero weights).
  static ScratchSize scratch(int64_t m, int64_t k) {
    return {DotKernel::scratch(m + kAmxRows, k).words, DotKernel::scratch(m, k).floats};
  }
  using Rows = typename DotKernel::Rows;
  using Input = typename DotKernel::Input;

  static void start_thread() { load_gemm_tiles(kGroupWords * 4, kGroupWords); }
  static void finish_thread() { release_tiles(); }

  template <int kRows, int kPanels, bool kSiluMul>
  static inline void tile(const Rows& rows, const uint8_t* panel, int64_t panel_bytes, const float* start, float* y,
                          int64_t ldy, int cols, const uint8_t* ahead, bool non_temporal) {
    amx_int8_tile<kFormat, kPanels, kSiluMul>(rows, kRows, panel, panel_bytes, start, y, ldy, cols, ahead,
                                              non_temporal);
  }
};
