// The widening GEMM micro-kernel for every weight format: a panel's blocks widened to fp32 in registers (one
// Decoder per format), multiplied with x by FMA. Included once per instruction set inside a `#pragma GCC target`
// region of linear_gemm.cc (no include guard, no includes: standard headers come before the region, and nothing
// from the standard library is instantiated here). Needs unroll.h, `Vec` (the instruction set's native fp32
// vector), `kMaxRows` (rows of x per register tile), `load_halves` (kLanes IEEE halves -> floats) and
// `fused_multiply_add` (a * b + c in one rounding).

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
// columns] in fp32; `finish` makes vector v of an output row from its sums and `start` (the bias or zeros),
// applying what is per column and not per block (INT8's scales).
template <Format kFormat>
struct Decoder;

// The sums as they are, plus start.
struct SumsFinish {
  static inline Vec finish(const uint8_t*, int, Vec sums, Vec start) { return sums + start; }
};

template <>
struct Decoder<Format::kF32> : SumsFinish {
  template <class Use>
  static inline void decode(const uint8_t* block, Use&& use) {
    Row w;
    for (int v = 0; v < kVecs; ++v) w.v[v] = load(block + v * sizeof(Vec));
    use(Index<0>{}, w);
  }
};

template <>
struct Decoder<Format::kBF16> : SumsFinish {
  // Each row is widened from its own load (an L1 hit): fewer registers live beside the accumulators.
  template <class Use>
  static inline void decode(const uint8_t* block, Use&& use) {
    Row even, odd;
    for (int v = 0; v < kVecs; ++v) even.v[v] = reinterpret_cast<Vec>(load_lanes(block + v * sizeof(Vec)) << 16);
    use(Index<0>{}, even);
    for (int v = 0; v < kVecs; ++v) odd.v[v] = reinterpret_cast<Vec>(load_lanes(block + v * sizeof(Vec)) & 0xffff0000u);
    use(Index<1>{}, odd);
  }
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
  // sums * scale + start in one rounding, whichever way the tile was inlined (GCC contracted it into an FMA only in
  // some of the tiles it inlined, so a tile's rows could round differently by its size).
  static inline Vec finish(const uint8_t* panel, int v, Vec sums, Vec start) {
    return fused_multiply_add(sums, load(panel + v * sizeof(Vec)), start);
  }
};

template <>
struct Decoder<Format::kQ8_0> : SumsFinish {
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
};

// Q4_0 and Q4_1: w = q * d + offset, offset = -8 d or m.
template <Format kFormat>
struct Q4Decoder : SumsFinish {
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

// The widening micro-kernel (gemm_driver.h): a panel's blocks widened to fp32 in registers by Decoder<kFormat>
// and multiplied with x as it is, kTileRows rows by one panel per tile. It reads every format: the GEMM of every
// CPU without the dot product a format's blocks feed (FormatTraits::kDot).
template <Format kFormat>
struct WideningKernel {
  static constexpr bool kReads = true;
  // AVX2 has 16 registers: a Q block's scales and offsets (4) leave room for 8 accumulators, not 12.
  static constexpr int kTileRows = kVecs > 1 && FormatTraits<kFormat>::kGeometry.block_k == 32 ? 4 : kMaxRows;
  // kTileRows rows a tile: a short tile's sums depend on its rows (kSplit), and even tiles were not measured here.
  static constexpr bool kEvenRowTiles = false;
  static constexpr int kMaxPanels = 1;

  static ScratchSize scratch(int64_t, int64_t) { return {0, 0}; }

  // Rows of x from a tile's first: x[r, 0:k] at x + r * k.
  struct Rows {
    const float* x;
    int64_t k;
  };
  struct Input {
    static constexpr bool kPrepares = false;
    const float* x;
    int64_t k;
    Input(const float* x, int64_t, int64_t k, const Scratch&) : x(x), k(k) {}
    void prepare(int64_t) const {}
    Rows rows(int64_t r0) const { return {x + r0 * k, k}; }
    int64_t row_bytes() const { return k * static_cast<int64_t>(sizeof(float)); }
  };

  // y[kRows, 0:cols] = start + x[kRows, 0:k] @ W[0:k, panel's 16 columns]; `start` holds the bias (or zeros) of
  // the panel's columns. `ahead` (or null): the next panel, asked for block by block.
  // flatten: every decoder and lambda inlined, so the accumulators stay in registers. Rows by value (two registers):
  // the tiles then inline where they did as functions of scalars.
  template <int kRows, int kPanels, bool kSiluMul>
  static inline __attribute__((flatten)) void tile(Rows rows, const uint8_t* panel, int64_t, const float* start,
                                                   float* y, int64_t ldy, int cols, const uint8_t* ahead,
                                                   bool non_temporal) {
    static_assert(kPanels == 1 && !kSiluMul, "a widening tile computes one panel");
    const float* x = rows.x;
    const int64_t ldx = rows.k, depth = rows.k;
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
          for (int64_t line = 0; line < kUnroll * kGeometry.block_bytes; line += 64) {
            __builtin_prefetch(next + line, 0, 0);
          }
        } else {
          for (int64_t line = 0; line < kUnroll * kGeometry.block_bytes; line += 64) {
            __builtin_prefetch(next + line, 0, 2);
          }
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
      float partial[kPanelWidth];
      float* to = cols == kPanelWidth ? y + r * ldy : partial;
      for (int v = 0; v < kVecs; ++v) {
        store(to + v * kLanes, D::finish(panel, v, acc[0][r].v[v], load(start + v * kLanes)));
      }
      if (cols < kPanelWidth) __builtin_memcpy(y + r * ldy, partial, cols * sizeof(float));
    }
  }
};
