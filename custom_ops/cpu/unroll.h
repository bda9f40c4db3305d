// The loops of the GEMM bodies (included inside their `#pragma GCC target` regions, once per instruction
// set; no include guard, nothing from the standard library instantiated beyond types).

template <int kIndex>
using Index = std::integral_constant<int, kIndex>;

// f(Index<0>{}), ..., f(Index<N - 1>{}): loop indices that stay compile-time constants.
template <class F, int... kIndices>
static inline __attribute__((always_inline)) void unrolled(F&& f, std::integer_sequence<int, kIndices...>) {
  (f(Index<kIndices>{}), ...);
}
template <int N, class F>
static inline __attribute__((always_inline)) void static_for(F&& f) {
  unrolled(f, std::make_integer_sequence<int, N>{});
}

// f(Index<rows>{}) for a run-time 1 <= rows <= N: a register tile of that many rows.
template <class F, int... kRows>
static inline __attribute__((always_inline)) void with_rows_of(int rows, F&& f, std::integer_sequence<int, kRows...>) {
  ((rows == kRows + 1 ? f(Index<kRows + 1>{}) : void()), ...);
}
template <int N, class F>
static inline __attribute__((always_inline)) void with_rows(int rows, F&& f) {
  with_rows_of(rows, f, std::make_integer_sequence<int, N>{});
}

// body(r0, rows) for the register tiles of rows [m0, m_end), at most kMaxRows rows each. kEven: as few tiles as
// that allows, their sizes within one of each other (64 rows of 12-row tiles: 11, 11, 11, 11, 10, 10, not 5 x 12 and
// a tile of 4, which keeps a third of its sums busy for a whole pass over the panels); else kMaxRows rows each, the
// last tile the rest.
template <int kMaxRows, bool kEven, class F>
static inline __attribute__((always_inline)) void for_each_row_tile(int64_t m0, int64_t m_end, F&& body) {
  if constexpr (kEven) {
    const int64_t rows = m_end - m0, tiles = (rows + kMaxRows - 1) / kMaxRows;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = m0 + rows * t / tiles;
      body(r0, static_cast<int>(m0 + rows * (t + 1) / tiles - r0));
    }
  } else {
    for (int64_t r0 = m0; r0 < m_end; r0 += kMaxRows) {
      body(r0, static_cast<int>(m_end - r0 < kMaxRows ? m_end - r0 : kMaxRows));
    }
  }
}

// body(p) for every p in [0, count), shared among the threads of the enclosing parallel region, with no
// barrier at the end. A GEMM of one tile of rows (a decode) streams its panels from memory once, and two
// vCPUs do not stream at the same rate: guided chunks let the faster thread take more panels instead of
// waiting at the barrier for the slower one (decode B=1 steps, paired in one process: 0.93-0.99x of the
// static split's, by dtype and run; decode B=64 unchanged).
// Larger GEMMs keep the static split, so that a thread computes the same panels for every block of rows.
template <class F>
static inline __attribute__((always_inline)) void for_each_panel(int64_t count, bool streamed, F&& body) {
  if (streamed) {
#pragma omp for schedule(guided) nowait
    for (int64_t p = 0; p < count; ++p) body(p);
  } else {
#pragma omp for schedule(static) nowait
    for (int64_t p = 0; p < count; ++p) body(p);
  }
}

// Whether the tile of rows starting at r0 asks for the panel after its own (prefetch into L2) as it computes:
// the first tile of a GEMM of kAskingRows rows or more. That tile reads each panel from memory (the later tiles
// of rows find it in cache), and with several rows it issues its loads too slowly to keep enough misses in
// flight: asking one panel ahead lets the next panel arrive while this one computes. Decode steps paired in one
// process (2 threads, every other step without; median per-pair ratio):
// - AMD EPYC Zen 4: B=8 bf16 0.936, int8 0.889, fp32 0.976, gguf 0.982 (its 4-bit panels already ask); B=4
//   slower (bf16 1.043 and 1.065, fp32 1.035, int8 1.017), B=6 bf16 1.016; hence 8 rows, not 4;
// - AMD EPYC Zen 5: B=8 0.80-0.84 (fp32, bf16, int8), B=16 0.77-0.85, B=64 0.90-0.95; prefill of 512
//   unchanged (0.95-1.00 per GEMM).
// Only the first block of rows asks: asking in every block measured slower for k=1536 at 512 rows (1.02-1.04x).
constexpr int64_t kAskingRows = 8;
static inline bool asks_ahead(int64_t m, int64_t r0) { return m >= kAskingRows && r0 == 0; }
