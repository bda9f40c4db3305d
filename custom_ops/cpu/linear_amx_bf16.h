// The GEMM micro-kernel for BF16 weights on AMX-BF16: tdpbf16ps multiplies tiles of bf16 pairs and sums in fp32,
// x rounded to bf16 once per call as for vdpbf16ps (linear_bf16.h, whose Input it shares). Included inside the
// amx_bf16 region of linear_gemm.cc after unroll.h and linear_bf16.h; no include guard, nothing from the standard
// library.
//
// A BF16 panel's blocks are already tdpbf16ps's B layout: a block is 64 bytes, lane c the pair (w[k0][c],
// w[k0 + 1][c]), so 16 consecutive blocks are a 16 x 64-byte tile of 32 inputs by 16 columns, loaded with a
// 64-byte stride. x's prepared rows (num_words words of bf16 pairs each) are the A tiles, 16 words of 16 rows.
// The sums accumulate in tiles over the whole depth (fp32, in tdpbf16ps's order: a different rounding than
// vdpbf16ps, not a different precision); the words past the last whole 16 (depth not a multiple of 32) are
// added by vdpbf16ps after the tiles are stored.

#include "amx_tiles.h"

constexpr int kAmxRows = 2 * kTileRegisterRows;  // rows of x per tile call: an upper and a lower A tile

// y[rows, kPanels panels] = start + x's rows . the panels (Bf16DotKernel::tile's contract, rows at run time).
// Tile registers: tmm0..3 the sums of (upper | lower rows) x (panel 0 | 1), tmm(2 * half + panel); tmm4, tmm5 the
// upper and lower rows of x; tmm6, tmm7 panel 0 and 1, as the thread configured them for the GEMM (load_gemm_tiles:
// 16 rows each, however many of them are x's). Not inlined: one body for every row count.
// `ahead` (or null): kPanels panels `ahead_panel_bytes` apart to ask for into L2 as the tile computes,
// `ahead_chunk_bytes` of each per 32 inputs of depth.
template <int kPanels, bool kSiluMul>
static __attribute__((noinline)) void amx_bf16_tile(const uint32_t* words, int64_t num_words, int rows,
                                                    const uint8_t* panel, int64_t panel_bytes, const float* start,
                                                    float* y, int64_t ldy, int cols, const uint8_t* ahead,
                                                    int64_t ahead_panel_bytes, int64_t ahead_chunk_bytes) {
  static_assert(!kSiluMul || kPanels == 2, "a SiLU tile pairs a gate panel with an up panel");
  const int upper = rows < kTileRegisterRows ? rows : kTileRegisterRows, lower = rows - upper;
  BS_TILE_ZERO(0);
  if (kPanels == 2) BS_TILE_ZERO(1);
  if (lower > 0) {
    BS_TILE_ZERO(2);
    if (kPanels == 2) BS_TILE_ZERO(3);
  }
  const uint8_t* x = reinterpret_cast<const uint8_t*>(words);
  const int64_t x_stride = num_words * 4, chunks = num_words / 16;
  constexpr int64_t kChunkBytes = 16 * 64;  // 16 blocks of a panel: one B tile
  for (int64_t c = 0; c < chunks; ++c) {
    if (ahead != nullptr) {
      for (int p = 0; p < kPanels; ++p) {
        const uint8_t* lines = ahead + p * ahead_panel_bytes + c * ahead_chunk_bytes;
        for (int64_t line = 0; line < ahead_chunk_bytes; line += 64) __builtin_prefetch(lines + line, 0, 2);
      }
    }
    BS_TILE_LOAD(6, panel + c * kChunkBytes, 64);
    if (kPanels == 2) BS_TILE_LOAD(7, panel + panel_bytes + c * kChunkBytes, 64);
    BS_TILE_LOAD(4, x + c * 64, x_stride);
    BS_TILE_DPBF16PS(0, 4, 6);
    if (kPanels == 2) BS_TILE_DPBF16PS(1, 4, 7);
    if (lower > 0) {
      BS_TILE_LOAD(5, x + kTileRegisterRows * x_stride + c * 64, x_stride);
      BS_TILE_DPBF16PS(2, 5, 6);
      if (kPanels == 2) BS_TILE_DPBF16PS(3, 5, 7);
    }
  }
  alignas(64) float sums[kAmxRows][2 * kPanelWidth];
  constexpr int64_t kSumsStride = sizeof sums[0];
  BS_TILE_STORE(0, &sums[0][0], kSumsStride);
  if (kPanels == 2) BS_TILE_STORE(1, &sums[0][kPanelWidth], kSumsStride);
  if (lower > 0) {
    BS_TILE_STORE(2, &sums[kTileRegisterRows][0], kSumsStride);
    if (kPanels == 2) BS_TILE_STORE(3, &sums[kTileRegisterRows][kPanelWidth], kSumsStride);
  }
  const __mmask16 last_columns = static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < rows; ++r) {
    __m512 acc[kPanels];
    for (int p = 0; p < kPanels; ++p) acc[p] = _mm512_load_ps(&sums[r][p * kPanelWidth]);
    for (int64_t w = chunks * 16; w < num_words; ++w) {  // the words past the tiles
      for (int p = 0; p < kPanels; ++p) {
        const __m512bh weights = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * panel_bytes + w * 64));
        acc[p] = dot_broadcast(acc[p], weights, &words[r * num_words + w]);
      }
    }
    if constexpr (kSiluMul) {
      const __m512 gate = _mm512_add_ps(acc[0], _mm512_loadu_ps(start));
      const __m512 up = _mm512_add_ps(acc[1], _mm512_loadu_ps(start + kPanelWidth));
      _mm512_storeu_ps(y + r * ldy, silu_times(gate, up));
    } else {
      for (int p = 0; p < kPanels; ++p) {
        const __mmask16 columns = p + 1 < kPanels ? static_cast<__mmask16>(0xffff) : last_columns;
        const __m512 bias = _mm512_maskz_loadu_ps(columns, start + p * kPanelWidth);
        _mm512_mask_storeu_ps(y + r * ldy + p * kPanelWidth, columns, _mm512_add_ps(acc[p], bias));
      }
    }
  }
}

// The micro-kernel (gemm_driver.h) of the BF16 format on AMX: Bf16DotKernel's prepared x, kAmxRows rows by two
// panels per tile (four 16 x 16 sums in tiles).
template <Format kFormat>
struct AmxBf16Kernel {
  using DotKernel = Bf16DotKernel<kFormat>;
  static constexpr bool kReads = DotKernel::kReads;
  static constexpr int kTileRows = kAmxRows;
  static constexpr bool kEvenRowTiles = false;
  static constexpr int kMaxPanels = 2;
  static constexpr int64_t kTwoPanelRows = 1;

  // Bf16DotKernel's, and kAmxRows rows of slack: a tile loads 16 (or 32) rows of x however many are left.
  static ScratchSize scratch(int64_t m, int64_t k) { return DotKernel::scratch(m + kAmxRows, k); }
  using Rows = typename DotKernel::Rows;
  using Input = typename DotKernel::Input;

  static void start_thread() { load_gemm_tiles(64, kTileRegisterRows); }
  static void finish_thread() { release_tiles(); }

  template <int kRows, int kPanels, bool kSiluMul>
  static inline void tile(Rows rows, const uint8_t* panel, int64_t panel_bytes, const float* start, float* y,
                          int64_t ldy, int cols, const uint8_t* ahead, bool) {
    amx_bf16_tile<kPanels, kSiluMul>(rows.words, rows.num_words, kRows, panel, panel_bytes, start, y, ldy, cols, ahead,
                                     panel_bytes, kTileRegisterRows * 64);  // a panel's B tile per 32 inputs
  }
};
