// The packed-weight GEMM body, included once per instruction set inside a `#pragma GCC target` region
// of linear_gemm.cc (no include guard, no includes: standard headers come before the region). Needs
// `Vec` (the instruction set's native fp32 vector) and `kMaxRows` (rows of x per register tile).

constexpr int kLanes = sizeof(Vec) / sizeof(float);
constexpr int kVecs = kPanelWidth / kLanes;  // vectors per row of a tile
typedef Vec UnalignedVec __attribute__((aligned(4)));

static inline Vec load(const float* from) { return *reinterpret_cast<const UnalignedVec*>(from); }
static inline void store(float* to, Vec value) { *reinterpret_cast<UnalignedVec*>(to) = value; }

// acc[rows] += x[rows, k] * panel[k, 0:16]
template <int kRows>
static inline void multiply_add(Vec (&acc)[kRows][kVecs], const float* x, int64_t ldx, const float* panel, int64_t k) {
  Vec weights[kVecs];
  for (int v = 0; v < kVecs; ++v) weights[v] = load(panel + k * kPanelWidth + v * kLanes);
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    const float scalar = x[r * ldx + k];
    for (int v = 0; v < kVecs; ++v) acc[r][v] += weights[v] * scalar;
  }
}

// y[rows, 0:cols] = start + x[rows, 0:depth] @ panel[0:depth, 0:16] for one 16-column weight panel;
// `start` holds the bias (or zeros) of the panel's 16 columns.
template <int kRows>
static inline void tile(const float* x, int64_t ldx, const float* panel, int64_t depth, const float* start, float* y,
                        int64_t ldy, int cols) {
  // A short tile has too few accumulators to cover the FMA latency: it keeps kSplit independent sums
  // over alternating k and adds them at the end (8 chains of FMAs in flight in all).
  constexpr int kSplit = kRows * kVecs >= 8 ? 1 : 8 / (kRows * kVecs);
  Vec acc[kSplit][kRows][kVecs] = {};
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[0][r][v] = load(start + v * kLanes);
  }
  int64_t k = 0;
  for (; k + kSplit <= depth; k += kSplit) {
#pragma GCC unroll 8
    for (int s = 0; s < kSplit; ++s) multiply_add<kRows>(acc[s], x, ldx, panel, k + s);
  }
  for (; k < depth; ++k) multiply_add<kRows>(acc[0], x, ldx, panel, k);
  for (int s = 1; s < kSplit; ++s) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) acc[0][r][v] += acc[s][r][v];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float partial[kPanelWidth];
    float* to = cols == kPanelWidth ? y + r * ldy : partial;
    for (int v = 0; v < kVecs; ++v) store(to + v * kLanes, acc[0][r][v]);
    if (cols < kPanelWidth) std::memcpy(y + r * ldy, partial, cols * sizeof(float));
  }
}

template <int... kRows>
static inline void tile_of(int rows, std::integer_sequence<int, kRows...>, const float* x, int64_t ldx,
                           const float* panel, int64_t depth, const float* start, float* y, int64_t ldy, int cols) {
  ((rows == kRows + 1 ? tile<kRows + 1>(x, ldx, panel, depth, start, y, ldy, cols) : void()), ...);
}

// y[m, n] = x[m, k] @ W (+ bias) with W packed by pack_weight. Threads split the weight panels; each
// panel meets a block of x rows small enough to stay in L2 (block_rows) over the whole depth, so every
// output tile is summed in registers and written once.
static void gemm(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias, float* y) {
  const int64_t panels = num_panels(n);
  const int64_t block_rows = std::max<int64_t>(kMaxRows, kBlockBytes / (k * sizeof(float)) / kMaxRows * kMaxRows);
#pragma omp parallel
  for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
    const int64_t m_end = std::min(m, m0 + block_rows);
#pragma omp for schedule(static) nowait
    for (int64_t p = 0; p < panels; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanelWidth, n - p * kPanelWidth));
      float start[kPanelWidth] = {};
      if (bias != nullptr) std::memcpy(start, bias + p * kPanelWidth, cols * sizeof(float));
      const float* panel = packed + p * k * kPanelWidth;
      for (int64_t r0 = m0; r0 < m_end; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m_end - r0));
        tile_of(rows, std::make_integer_sequence<int, kMaxRows>{}, x + r0 * k, k, panel, k, start,
                y + r0 * n + p * kPanelWidth, n, cols);
      }
    }
  }
}
