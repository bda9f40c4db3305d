// The packed-weight GEMM body for every weight format, widened to fp32 in registers: included once per
// instruction set inside a `#pragma GCC target` region of linear_gemm.cc (no include guard, no includes:
// standard headers come before the region, and nothing from the standard library is instantiated
// here). Needs unroll.h, `Vec` (the instruction set's native fp32 vector), `kMaxRows` (rows of x per
// register tile) and `load_halves` (kLanes IEEE halves -> floats).

constexpr int kLanes = sizeof(Vec) / sizeof(float);
constexpr int kVecs = kPanelWidth / kLanes;  // vectors per row of a tile
typedef int32_t IVec __attribute__((vector_size(sizeof(Vec))));
typedef uint32_t UVec __attribute__((vector_size(sizeof(Vec))));
typedef Vec UnalignedVec __attribute__((aligned(4)));
typedef UVec UnalignedUVec __attribute__((aligned(4)));

// 16 columns of one input row of W (or of one output row), as kVecs vectors.
struct Row {
  Vec v[kVecs];
};

static inline Vec load(const void* from) { return *reinterpret_cast<const UnalignedVec*>(from); }
static inline UVec load_lanes(const void* from) { return *reinterpret_cast<const UnalignedUVec*>(from); }
static inline void store(float* to, Vec value) { *reinterpret_cast<UnalignedVec*>(to) = value; }
static inline Vec to_float(IVec value) { return __builtin_convertvector(value, Vec); }

static inline Row halves_row(const uint8_t* from) {
  Row row;
  for (int v = 0; v < kVecs; ++v) row.v[v] = load_halves(from + v * kLanes * 2);
  return row;
}

// Each decoder calls use(Index<kk>{}, w) for the block's input rows kk = 0..block_k, w holding W[k0 + kk, 16
// columns] in fp32; `finish` applies what is per column and not per block (INT8's scales).
template <Format kFormat>
struct Decoder;

template <>
struct Decoder<Format::kF32> {
  template <class Use>
  static inline void decode(const uint8_t* block, Use&& use) {
    Row w;
    for (int v = 0; v < kVecs; ++v) w.v[v] = load(block + v * sizeof(Vec));
    use(Index<0>{}, w);
  }
  static inline void finish(const uint8_t*, Row&) {}
};

template <>
struct Decoder<Format::kBF16> {
  // Each row is widened from its own load (an L1 hit): fewer registers live beside the accumulators.
  template <class Use>
  static inline void decode(const uint8_t* block, Use&& use) {
    Row even, odd;
    for (int v = 0; v < kVecs; ++v) even.v[v] = reinterpret_cast<Vec>(load_lanes(block + v * sizeof(Vec)) << 16);
    use(Index<0>{}, even);
    for (int v = 0; v < kVecs; ++v) odd.v[v] = reinterpret_cast<Vec>(load_lanes(block + v * sizeof(Vec)) & 0xffff0000u);
    use(Index<1>{}, odd);
  }
  static inline void finish(const uint8_t*, Row&) {}
};

// Byte j of each lane holding a value + 128, as the value in floats.
template <int j>
static inline Vec biased_byte(UVec lanes) {
  const UVec flipped = lanes ^ 0x80808080u;  // value + 128 -> the value's two's complement
  return to_float(reinterpret_cast<IVec>(flipped << (24 - 8 * j)) >> 24);
}

template <>
struct Decoder<Format::kInt8> {
  template <class Use>
  static inline void decode(const uint8_t* block, Use&& use) {
    static_for<4>([&](auto j) {
      Row w;
      for (int v = 0; v < kVecs; ++v) w.v[v] = biased_byte<decltype(j)::value>(load_lanes(block + v * sizeof(Vec)));
      use(j, w);
    });
  }
  static inline void finish(const uint8_t* panel, Row& acc) {
    for (int v = 0; v < kVecs; ++v) acc.v[v] *= load(panel + v * sizeof(Vec));
  }
};

template <>
struct Decoder<Format::kQ8_0> {
  template <class Use>
  static inline void decode(const uint8_t* block, Use&& use) {
    const Row d = halves_row(block);
    static_for<8>([&](auto g) {
      const uint8_t* lanes = block + 32 + decltype(g)::value * 64;
      static_for<4>([&](auto j) {
        Row w;
        for (int v = 0; v < kVecs; ++v) {
          w.v[v] = biased_byte<decltype(j)::value>(load_lanes(lanes + v * sizeof(Vec))) * d.v[v];
        }
        use(Index<4 * decltype(g)::value + decltype(j)::value>{}, w);
      });
    });
  }
  static inline void finish(const uint8_t*, Row&) {}
};

// Q4_0 and Q4_1: w = q * d + offset, offset = -8 d or m.
template <Format kFormat>
struct Q4Decoder {
  template <class Use>
  static inline void decode(const uint8_t* block, Use&& use) {
    const Row d = halves_row(block);
    Row offset;
    if (kFormat == Format::kQ4_1) {
      offset = halves_row(block + 32);
    } else {
      for (int v = 0; v < kVecs; ++v) offset.v[v] = d.v[v] * -8.0f;
    }
    constexpr int kQuants = kFormat == Format::kQ4_1 ? 64 : 32;
    static_for<4>([&](auto g) {
      const uint8_t* lanes = block + kQuants + decltype(g)::value * 64;
      static_for<8>([&](auto j) {
        constexpr int kShift = decltype(j)::value < 4 ? 8 * decltype(j)::value : 8 * (decltype(j)::value - 4) + 4;
        Row w;
        for (int v = 0; v < kVecs; ++v) {
          const UVec nibbles = load_lanes(lanes + v * sizeof(Vec)) >> kShift;
          const Vec q = to_float(reinterpret_cast<IVec>(nibbles & 0xfu));
          w.v[v] = q * d.v[v] + offset.v[v];
        }
        use(Index<8 * decltype(g)::value + decltype(j)::value>{}, w);
      });
    });
  }
  static inline void finish(const uint8_t*, Row&) {}
};

template <>
struct Decoder<Format::kQ4_0> : Q4Decoder<Format::kQ4_0> {};
template <>
struct Decoder<Format::kQ4_1> : Q4Decoder<Format::kQ4_1> {};

// acc[r] += x[r, 0] * w for the tile's rows (x points at this input row's column of x).
template <int kRows>
static inline void multiply_add(Row (&acc)[kRows], const Row& w, const float* x, int64_t ldx) {
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    const float scalar = x[r * ldx];
    for (int v = 0; v < kVecs; ++v) acc[r].v[v] += w.v[v] * scalar;
  }
}

// y[rows, 0:cols] = start + x[rows, 0:depth] @ W[0:depth, panel's 16 columns]; `start` holds the bias (or
// zeros) of the panel's columns. `ahead` (or null): the next panel, asked for block by block (asks_ahead, or
// kAsksFromOneRow), non-temporally where `non_temporal`.
// flatten: every decoder and lambda inlined, so the accumulators stay in registers.
template <Format kFormat, int kRows>
static inline __attribute__((flatten)) void tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t depth, const float* start, float* y,
                        int64_t ldy, int cols, const uint8_t* ahead, bool non_temporal) {
  using D = Decoder<kFormat>;
  constexpr Geometry kGeometry = FormatTraits<kFormat>::kGeometry;
  constexpr int kBlockK = static_cast<int>(kGeometry.block_k);
  // A short tile has too few accumulators to cover the FMA latency: it keeps kSplit independent sums
  // over alternating k and adds them at the end (8 chains of FMAs in flight in all).
  constexpr int kSplit = kRows * kVecs >= 8 ? 1 : 8 / (kRows * kVecs);
  constexpr int kUnroll = kSplit > kBlockK ? kSplit / kBlockK : 1;  // blocks per step: whole rounds of the split
  Row acc[kSplit][kRows] = {};
  const uint8_t* blocks = panel + kGeometry.header_bytes;
  const int64_t full_blocks = depth / kBlockK;
  int64_t b = 0;
  for (; b + kUnroll <= full_blocks; b += kUnroll) {
    if (ahead != nullptr) {
      const uint8_t* next = ahead + kGeometry.header_bytes + b * kGeometry.block_bytes;
      if (non_temporal) {
        for (int64_t line = 0; line < kUnroll * kGeometry.block_bytes; line += 64) __builtin_prefetch(next + line, 0, 0);
      } else {
        for (int64_t line = 0; line < kUnroll * kGeometry.block_bytes; line += 64) __builtin_prefetch(next + line, 0, 2);
      }
    }
    static_for<kUnroll>([&](auto u) {
      constexpr int kFirst = decltype(u)::value * kBlockK;
      D::decode(blocks + (b + decltype(u)::value) * kGeometry.block_bytes, [&](auto kk, const Row& w) {
        multiply_add<kRows>(acc[(kFirst + decltype(kk)::value) % kSplit], w, x + b * kBlockK + kFirst + kk, ldx);
      });
    });
  }
  for (; b < full_blocks; ++b) {
    D::decode(blocks + b * kGeometry.block_bytes, [&](auto kk, const Row& w) {
      multiply_add<kRows>(acc[decltype(kk)::value % kSplit], w, x + b * kBlockK + kk, ldx);
    });
  }
  if (const int64_t rest = depth - full_blocks * kBlockK; rest > 0) {  // x has no columns past depth
    D::decode(blocks + full_blocks * kGeometry.block_bytes, [&](auto kk, const Row& w) {
      if (kk < rest) multiply_add<kRows>(acc[0], w, x + full_blocks * kBlockK + kk, ldx);
    });
  }
  for (int s = 1; s < kSplit; ++s) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) acc[0][r].v[v] += acc[s][r].v[v];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    D::finish(panel, acc[0][r]);
    float partial[kPanelWidth];
    float* to = cols == kPanelWidth ? y + r * ldy : partial;
    for (int v = 0; v < kVecs; ++v) store(to + v * kLanes, acc[0][r].v[v] + load(start + v * kLanes));
    if (cols < kPanelWidth) __builtin_memcpy(y + r * ldy, partial, cols * sizeof(float));
  }
}

// y[m, n] = x[m, k] @ W (+ bias) with W packed in kFormat. Threads split the weight panels; each panel meets
// a block of x rows small enough to stay in L2 (block_rows) over the whole depth, so every output tile is
// summed in registers and written once. GGUF panels ask from one row (FormatTraits::kAsksFromOneRow, weight_format.h): gguf decode
// steps of one sequence on this code (BLOCKSERVE_CPU_ISA=avx2 and avx512 on an AMD EPYC Zen 4, 2 threads),
// paired in one process as in linear_vnni.h, median pair ratio asking / before: AVX2 0.970, 0.968, 0.994;
// AVX-512F 0.983, 0.988.
template <Format kFormat>
static void gemm_of(const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, const float* bias,
                    float* y) {
  // AVX2 has 16 registers: a Q block's scales and offsets (4) leave room for 8 accumulators, not 12.
  constexpr int kTileRows = kVecs > 1 && FormatTraits<kFormat>::kGeometry.block_k == 32 ? 4 : kMaxRows;
  const int64_t panels = num_panels(n), bytes = panel_bytes(kFormat, k);
  const int64_t fitting_rows = kBlockBytes / (k * static_cast<int64_t>(sizeof(float))) / kTileRows * kTileRows;
  const int64_t block_rows = fitting_rows > kTileRows ? fitting_rows : kTileRows;
#pragma omp parallel
  for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
    const int64_t m_end = m < m0 + block_rows ? m : m0 + block_rows;
    for_each_panel(panels, m <= kTileRows, [&](int64_t p) {
      const int64_t remaining = n - p * kPanelWidth;
      const int cols = static_cast<int>(remaining < kPanelWidth ? remaining : kPanelWidth);
      float start[kPanelWidth] = {};
      if (bias != nullptr) __builtin_memcpy(start, bias + p * kPanelWidth, cols * sizeof(float));
      for (int64_t r0 = m0; r0 < m_end; r0 += kTileRows) {
        const int rows = static_cast<int>(m_end - r0 < kTileRows ? m_end - r0 : kTileRows);
        with_rows<kTileRows>(rows, [&](auto tile_rows) {
          const bool asks = (FormatTraits<kFormat>::kAsksFromOneRow && r0 == 0) || asks_ahead(m, r0);
          const uint8_t* ahead = asks && p + 1 < panels ? packed + (p + 1) * bytes : nullptr;
          tile<kFormat, decltype(tile_rows)::value>(x + r0 * k, k, packed + p * bytes, k, start,
                                                    y + r0 * n + p * kPanelWidth, n, cols, ahead,
                                                    m < kAskingRows);
        });
      }
    });
  }
}

static void gemm(Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n,
                 const float* bias, float* y) {
  visit_format(format, [&](auto tag) { gemm_of<tag.value>(x, m, k, packed, n, bias, y); });
}
