// The packed-weight GEMM's loop, written once over a micro-kernel: threads split the weight's panels; each panel
// meets a block of x rows small enough to stay in L2 (with the panel) over the whole depth, so every output tile
// is summed in registers and written once; the micro-kernel computes one register tile. Included inside each
// instruction set's region of linear_gemm.cc after unroll.h, the micro-kernel's header and the region's
// `MicroKernel<format>` alias; no include guard, nothing from the standard library instantiated.
//
// A micro-kernel (linear_tile.h, linear_bf16.h, linear_vnni.h) is a policy, static members only:
//   kReads                  whether it reads the format's blocks at all
//   kTileRows               rows of x per register tile, at most
//   kEvenRowTiles           a block's tiles as even in rows as for_each_row_tile makes them, or kTileRows rows each
//   kMaxPanels              panels per tile, at most (2: from kTwoPanelRows rows of x, tiles take two panels, and a
//                           gate|up weight's tiles may pair a gate panel with its up panel: gemm_silu_and_mul)
//   scratch(m, k)           the scratch of x prepared for its tiles (ScratchSize)
//   Input(x, m, k, scratch) x as its tiles read it: kPrepares, prepare(r) (row r, once per call), rows(r0) (the
//                           tile's from row r0), row_bytes() (of one prepared row: what a block of rows keeps in L2)
//   tile<kRows, kPanels, kSiluMul>(rows, panel, panel_stride, start, y, ldy, cols, ahead, non_temporal)
//                           y[kRows, kPanels panels] = start + rows . the panels (`panel_stride` bytes apart; all 16
//                           columns but the last panel's `cols`), or with kSiluMul y[kRows, 16] = silu(gate) * up
//                           of a gate panel and its up panel; `ahead` (or null): the next tile's panels, to ask for
//                           as it computes, non-temporally where `non_temporal`.

// Whether the tile of rows from r0 asks for the next tile's panels as it computes (asks_ahead), and from one row
// where the format's blocks want that (FormatTraits::kAsksFromOneRow: gguf decode steps of one sequence on the
// widening kernel, BLOCKSERVE_CPU_ISA=avx2 and avx512 on an AMD EPYC Zen 4, 2 threads, paired in one process as in
// linear_vnni.h, median pair ratio asking / before: AVX2 0.970, 0.968, 0.994; AVX-512F 0.983, 0.988).
template <Format kFormat>
static inline bool asks_ahead_of(int64_t m, int64_t r0) {
  return (FormatTraits<kFormat>::kAsksFromOneRow && r0 == 0) || asks_ahead(m, r0);
}

// A micro-kernel on AMX tiles (static start_thread() and finish_thread()) configures them once per thread and GEMM,
// before the thread's first tile, and releases them after its last. Other micro-kernels have nothing to do there.
template <class K>
static inline auto start_thread(int) -> decltype(K::start_thread(), void()) {
  K::start_thread();
}
template <class K>
static inline void start_thread(long) {}
template <class K>
static inline auto finish_thread(int) -> decltype(K::finish_thread(), void()) {
  K::finish_thread();
}
template <class K>
static inline void finish_thread(long) {}

// Bytes of x rows a block of rows holds: the micro-kernel's kBlockBytes where it has one, else linear_gemm.cc's.
template <class K>
static constexpr auto block_bytes_of(int) -> decltype(K::kBlockBytes, int64_t()) {
  return K::kBlockBytes;
}
template <class K>
static constexpr int64_t block_bytes_of(long) {
  return kBlockBytes;
}

// y[m, n] = x[m, k] @ W (+ bias) with W packed in kFormat, on K = MicroKernel<kFormat>; or (kSiluMul, no bias)
// y[m, n / 2] = silu(x @ W[:, :n / 2]) * (x @ W[:, n / 2:]) for a gate|up weight (n / 2 a multiple of 16,
// m >= K::kTwoPanelRows): each tile pairs gate panel g with up panel n / 32 + g and applies silu_and_mul_row's
// arithmetic to its accumulators, so the [m, n] product is never written and read back.
// Tile t of a row block reads tile_panels panels (`stride` panels apart) from panel t * step and writes y's columns
// from that panel's first.
template <Format kFormat, bool kSiluMul = false>
static void gemm_with(const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, const float* bias,
                      float* y, const Scratch& scratch) {
  using K = MicroKernel<kFormat>;
  constexpr int kTileRows = K::kTileRows;
  typename K::Input input(x, m, k, scratch);
  const int64_t panels = num_panels(n), bytes = panel_bytes(kFormat, k);
  int64_t step = 1, stride = 1, num_tiles = panels, whole_tiles = panels, ldy = n;
  if constexpr (kSiluMul) {
    stride = num_tiles = whole_tiles = panels / 2;
    ldy = n / 2;
  } else if constexpr (K::kMaxPanels == 2) {
    step = m >= K::kTwoPanelRows ? 2 : 1;
    num_tiles = (panels + step - 1) / step;
    whole_tiles = panels / step;  // a tile asks ahead for a whole tile's panels
  }
  const int64_t fitting_rows = block_bytes_of<K>(0) / input.row_bytes() / kTileRows * kTileRows;
  const int64_t block_rows = fitting_rows > kTileRows ? fitting_rows : kTileRows;
  const bool rows_in_parallel = m > kTileRows;  // a tile's worth of rows is prepared faster than a barrier
  if constexpr (K::Input::kPrepares) {
    if (!rows_in_parallel) {
      for (int64_t r = 0; r < m; ++r) input.prepare(r);
    }
  }
#pragma omp parallel
  {
    start_thread<K>(0);
    if constexpr (K::Input::kPrepares) {
      if (rows_in_parallel) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) input.prepare(r);
      }
    }
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
      const int64_t m_end = m < m0 + block_rows ? m : m0 + block_rows;
      for_each_panel(num_tiles, !rows_in_parallel, [&](int64_t t) {
        const int64_t first = t * step;
        const int64_t tile_panels = kSiluMul ? 2 : panels - first < step ? panels - first : step;
        const int64_t remaining = n - first * kPanelWidth;
        const int64_t tile_cols = remaining < tile_panels * kPanelWidth ? remaining : tile_panels * kPanelWidth;
        const int cols = kSiluMul ? kPanelWidth : static_cast<int>(tile_cols - (tile_panels - 1) * kPanelWidth);
        float start[K::kMaxPanels * kPanelWidth] = {};  // the bias of the tile's columns, or zeros
        if (bias != nullptr) __builtin_memcpy(start, bias + first * kPanelWidth, tile_cols * sizeof(float));
        const uint8_t* next = t + 1 < whole_tiles ? packed + (first + step) * bytes : nullptr;
        for_each_row_tile<kTileRows, K::kEvenRowTiles>(m0, m_end, [&](int64_t r0, int count) {
          with_rows<kTileRows>(count, [&](auto rows) {
            constexpr int kRows = decltype(rows)::value;
            const uint8_t* ahead = asks_ahead_of<kFormat>(m, r0) ? next : nullptr;
            float* out = y + r0 * ldy + first * kPanelWidth;
            const auto tile_input = input.rows(r0);
            if constexpr (kSiluMul) {
              K::template tile<kRows, 2, true>(tile_input, packed + first * bytes, stride * bytes, start, out, ldy,
                                               cols, ahead, m < kAskingRows);
            } else if constexpr (K::kMaxPanels == 2) {
              if (tile_panels == 2) {
                K::template tile<kRows, 2, false>(tile_input, packed + first * bytes, bytes, start, out, ldy, cols,
                                                  ahead, m < kAskingRows);
              } else {
                K::template tile<kRows, 1, false>(tile_input, packed + first * bytes, bytes, start, out, ldy, cols,
                                                  ahead, m < kAskingRows);
              }
            } else {
              K::template tile<kRows, 1, false>(tile_input, packed + first * bytes, bytes, start, out, ldy, cols,
                                                ahead, m < kAskingRows);
            }
          });
        });
      });
    }
    finish_thread<K>(0);
  }
}

// The region's entry points, over its MicroKernel<format> (linear_gemm.cc's table of micro-kernels).
namespace entry {

static bool reads(Format format) {
  bool reads = false;
  visit_format(format, [&](auto tag) { reads = MicroKernel<tag.value>::kReads; });
  return reads;
}

static ScratchSize scratch(Format format, int64_t m, int64_t k) {
  ScratchSize size{0, 0};
  visit_format(format, [&](auto tag) { size = MicroKernel<tag.value>::scratch(m, k); });
  return size;
}

static void gemm(Format format, const GemmCall& call, const Scratch& scratch) {
  visit_format(format, [&](auto tag) {
    using K = MicroKernel<tag.value>;
    if constexpr (MicroKernel<tag.value>::kReads) {
      gemm_with<tag.value>(call.x, call.m, call.k, call.packed, call.n, call.bias, call.y, scratch);
    }
  });
}

static bool fuses_silu_and_mul(Format format, int64_t m) {
  bool fuses = false;
  visit_format(format, [&](auto tag) {
    using K = MicroKernel<tag.value>;
    if constexpr (K::kReads && K::kMaxPanels == 2) fuses = m >= K::kTwoPanelRows;
  });
  return fuses;
}

static void gemm_silu_and_mul(Format format, const GemmCall& call, const Scratch& scratch) {
  visit_format(format, [&](auto tag) {
    using K = MicroKernel<tag.value>;
    if constexpr (K::kReads && K::kMaxPanels == 2) {
      gemm_with<tag.value, true>(call.x, call.m, call.k, call.packed, call.n, nullptr, call.y, scratch);
    }
  });
}

constexpr MicroKernelEntries kEntries = {reads, scratch, gemm, fuses_silu_and_mul, gemm_silu_and_mul};

}  // namespace entry
