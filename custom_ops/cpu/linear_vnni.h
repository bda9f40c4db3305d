// The packed-weight GEMM for the 8- and 4-bit formats (INT8, Q8_0, Q4_0, Q4_1) on AVX512-VNNI. x is
// quantized per row and group of 32 inputs to int8 as llama.cpp quantizes activations (q = rint(x * 127 /
// max|x|), scale sx = max|x| / 127); vpdpbusd sums a group's (weight byte, q) products in int32, and each
// group's sum goes into an fp32 accumulator scaled: acc += (d * sx) * sum + offset * (sx * sum of q), for
// weights worth d * byte + offset (INT8: d = 1, offset = -128, its column scale applied at the end; Q8_0:
// offset = -128 d; Q4_0: -8 d; Q4_1: m). Included inside the avx512_vnni region of linear_gemm.cc after
// unroll.h; no include guard, nothing from the standard library.

constexpr int64_t kGroup = 32;  // inputs per activation scale (and per GGUF block)
constexpr int kGroupWords = 8;  // 4 inputs per word
constexpr int kMaxRows = 12;    // 12 int32 sums + 12 fp32 accumulators of the 32 zmm

// One row of x: q as 4-byte words, and per group its scale and scale * sum of q.
static inline void prepare_row(const float* x, int64_t k, int64_t num_words, uint32_t* words, float* scales,
                               float* scaled_sums) {
  uint8_t* bytes = reinterpret_cast<uint8_t*>(words);
  const int64_t padded = num_words * 4;
  for (int64_t first = 0, g = 0; first < padded; first += kGroup, ++g) {
    const int64_t rest = k - first;
    const __mmask16 low = rest >= 16 ? 0xffff : static_cast<__mmask16>((1u << rest) - 1);
    const __mmask16 high = rest >= 32 ? 0xffff : rest <= 16 ? 0 : static_cast<__mmask16>((1u << (rest - 16)) - 1);
    const __m512 x_low = _mm512_maskz_loadu_ps(low, x + first), x_high = _mm512_maskz_loadu_ps(high, x + first + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x_low), _mm512_abs_ps(x_high)));
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(x_low, inverse));
    const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(x_high, inverse));
    scales[g] = amax / 127.0f;
    scaled_sums[g] = scales[g] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)));
    uint8_t group_bytes[kGroup];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(group_bytes), _mm512_cvtepi32_epi8(q_low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(group_bytes + 16), _mm512_cvtepi32_epi8(q_high));
    __builtin_memcpy(bytes + first, group_bytes, padded - first < kGroup ? padded - first : kGroup);
  }
}

// A panel's group g: use(word in group, 64 weight bytes) for its words, and its d and offset per column.
template <Format kFormat>
struct Group;

template <>
struct Group<Format::kInt8> {  // the scale per column is applied after the last group
  template <class Use>
  static inline void words(const uint8_t* blocks, int64_t g, int64_t num_words, __m512& d, __m512& offset, Use&& use) {
    d = _mm512_set1_ps(1.0f);
    offset = _mm512_set1_ps(-128.0f);
    static_for<kGroupWords>([&](auto w) {
      const int64_t word = g * kGroupWords + w;
      if (word < num_words) use(w, _mm512_loadu_si512(blocks + word * 64));  // the last group may be short
    });
  }
};

template <>
struct Group<Format::kQ8_0> {
  template <class Use>
  static inline void words(const uint8_t* blocks, int64_t g, int64_t, __m512& d, __m512& offset, Use&& use) {
    const uint8_t* block = blocks + g * FormatTraits<Format::kQ8_0>::kGeometry.block_bytes;
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
    offset = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
    static_for<kGroupWords>([&](auto w) { use(w, _mm512_loadu_si512(block + 32 + w * 64)); });
  }
};

template <Format kFormat>
struct Q4Group {
  template <class Use>
  static inline void words(const uint8_t* blocks, int64_t g, int64_t, __m512& d, __m512& offset, Use&& use) {
    const uint8_t* block = blocks + g * FormatTraits<kFormat>::kGeometry.block_bytes;
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
    offset = kFormat == Format::kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)))
                                      : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    constexpr int kQuants = kFormat == Format::kQ4_1 ? 64 : 32;
    const __m512i nibbles = _mm512_set1_epi8(0x0f);
    static_for<kGroupWords / 2>([&](auto s) {  // 8 inputs: byte j holds input j low, j + 4 high
      const __m512i pairs = _mm512_loadu_si512(block + kQuants + s * 64);
      use(Index<2 * decltype(s)::value>{}, _mm512_and_si512(pairs, nibbles));
      use(Index<2 * decltype(s)::value + 1>{}, _mm512_and_si512(_mm512_srli_epi32(pairs, 4), nibbles));
    });
  }
};

template <>
struct Group<Format::kQ4_0> : Q4Group<Format::kQ4_0> {};
template <>
struct Group<Format::kQ4_1> : Q4Group<Format::kQ4_1> {};

// The micro-kernel (gemm_driver.h) of the formats whose blocks are unsigned bytes for vpdpbusd
// (FormatTraits::kDot == Dot::kInt8): x quantized per row and group of 32 inputs, kMaxRows rows by one panel per tile.
template <Format kFormat>
struct Int8DotKernel {
  static constexpr bool kReads = FormatTraits<kFormat>::kDot == Dot::kInt8;
  static constexpr int kTileRows = kMaxRows;
  static constexpr bool kEvenRowTiles = true;
  static constexpr int kMaxPanels = 1;

  // Words of x per row: 4 inputs each, k rounded up to whole blocks; and groups of kGroupWords of them.
  static int64_t num_words_of(int64_t k) {
    return num_blocks(kFormat, k) * (FormatTraits<kFormat>::kGeometry.block_k / 4);
  }
  static int64_t num_groups_of(int64_t k) { return (num_words_of(k) + kGroupWords - 1) / kGroupWords; }
  // words [m, num_words]; floats: scales [m, num_groups], then scaled sums [m, num_groups].
  static ScratchSize scratch(int64_t m, int64_t k) { return {m * num_words_of(k), 2 * m * num_groups_of(k)}; }

  // Rows of x prepared for one tile: words [rows, num_words], per group scales and scaled sums [rows, groups].
  struct Rows {
    const uint32_t* words;
    const float* scales;
    const float* scaled_sums;
    int64_t num_words, num_groups;
  };
  struct Input {
    static constexpr bool kPrepares = true;
    const float* x;
    int64_t k;
    uint32_t* words;
    float *scales, *scaled_sums;
    int64_t num_words, num_groups;
    Input(const float* x, int64_t m, int64_t k, const Scratch& scratch)
        : x(x), k(k), words(scratch.words), scales(scratch.floats), scaled_sums(scratch.floats + m * num_groups_of(k)),
          num_words(num_words_of(k)), num_groups(num_groups_of(k)) {}
    void prepare(int64_t r) const {
      prepare_row(x + r * k, k, num_words, words + r * num_words, scales + r * num_groups,
                  scaled_sums + r * num_groups);
    }
    Rows rows(int64_t r0) const {
      return {words + r0 * num_words, scales + r0 * num_groups, scaled_sums + r0 * num_groups, num_words, num_groups};
    }
    int64_t row_bytes() const { return num_words * 4; }
  };

  // A tile asks for the next panel (`ahead`, or null), each group's bytes as it reaches the same group of its own: the
  // first tile of rows, from kAskingRows rows (asks_ahead), and a GGUF block panel's from one row
  // (FormatTraits::kAsksFromOneRow, weight_format.h). A 4-bit panel takes more instructions per byte than the loads
  // alone, so even one row's loop issues its loads too slowly to keep enough misses in flight. Measured on one
  // sequence's decode of the default model (gguf, AMD EPYC Zen 5, 2 threads, the decoder stack timed per GEMM, runs
  // alternated): the 30 layers' gate_up 578 us a step without (mean of 8 runs), 481 with (10 runs), down 328 and 296;
  // whole steps moved less than the host's noise. At one row, asking for INT8 and BF16 panels too measured no faster
  // (int8 steps 3.63 ms without, 3.69 with; bf16 6.4 and 6.8).
  // Below kAskingRows (a decode of a few sequences streams each panel from memory once a step), the asks are
  // non-temporal (PREFETCHNTA): the panels then pass through the caches without pushing the rest out of the L3, which
  // is what the step's attention (the KV cache) and everything after the lm_head (sampling, Python, the next step's
  // inputs) find there. Q8_0 panels (the default model's tied embedding and lm_head, 29 MiB read last in a step) ask
  // from one row for that: the lm_head itself takes longer (+40-180 us of ~0.75-0.95 ms) but the step less. gguf
  // decode steps of one sequence, AMD EPYC Zen 4 (2 vCPUs, KVM), paired in one process, every step after a 1 GiB read
  // and an untimed step, median pair ratio of 80-200 pairs (asking, non-temporal / before) in 11 runs: 0.864-1.006,
  // median 0.958 (the larger gains when the host's other tenants were quiet; whole runs alternated by process moved
  // less than the host's noise). Q4 asks made non-temporal alone: 0.963, 1.000; Q8_0 asks at locality 2 (no hint):
  // 1.040, as before. Asking non-temporally for BF16 and INT8 panels at one row measured slower (1.111, 1.055): the
  // asks add as many instructions as those loops' loads.
  template <int kRows, int kPanels, bool kSiluMul>
  static inline __attribute__((flatten)) void tile(const Rows& x, const uint8_t* panel, int64_t, const float* start,
                                                   float* y, int64_t ldy, int cols, const uint8_t* ahead,
                                                   bool non_temporal) {
    static_assert(kPanels == 1 && !kSiluMul, "an int8 tile computes one panel");
    constexpr int kSplit = kRows >= 4 ? 1 : 2;  // a short tile sums even and odd words apart (latency)
    const uint8_t* blocks = panel + FormatTraits<kFormat>::kGeometry.header_bytes;
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < x.num_groups; ++g) {
      __m512i sums[kSplit][kRows];
      for (int s = 0; s < kSplit; ++s) {
        for (int r = 0; r < kRows; ++r) sums[s][r] = _mm512_setzero_si512();
      }
      if (ahead != nullptr) {
        constexpr Geometry kGeometry = FormatTraits<kFormat>::kGeometry;
        constexpr int64_t kGroupBytes = kGeometry.block_bytes * (kGroup / kGeometry.block_k);  // INT8: 8 blocks
        const uint8_t* group = ahead + kGeometry.header_bytes + g * kGroupBytes;
        if (non_temporal) {
          for (int64_t line = 0; line < kGroupBytes; line += 64) __builtin_prefetch(group + line, 0, 0);
        } else {
          for (int64_t line = 0; line < kGroupBytes; line += 64) __builtin_prefetch(group + line, 0, 2);
        }
      }
      __m512 d, offset;
      Group<kFormat>::words(blocks, g, x.num_words, d, offset, [&](auto w, __m512i weights) {
        constexpr int kSum = decltype(w)::value % kSplit;
        const uint32_t* word = x.words + g * kGroupWords + w;
#pragma GCC unroll 16
        for (int r = 0; r < kRows; ++r) {
          const __m512i x_word = _mm512_set1_epi32(static_cast<int>(word[r * x.num_words]));
          sums[kSum][r] = _mm512_dpbusd_epi32(sums[kSum][r], weights, x_word);
        }
      });
      for (int r = 0; r < kRows; ++r) {
        const __m512i sum = kSplit == 1 ? sums[0][r] : _mm512_add_epi32(sums[0][r], sums[kSplit - 1][r]);
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x.scales[r * x.num_groups + g]));
        acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), acc[r]);
        acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.scaled_sums[r * x.num_groups + g]), acc[r]);
      }
    }
    const __mmask16 columns = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 bias = _mm512_maskz_loadu_ps(columns, start);
    for (int r = 0; r < kRows; ++r) {
      if (kFormat == Format::kInt8) acc[r] = _mm512_mul_ps(acc[r], _mm512_loadu_ps(panel));
      _mm512_mask_storeu_ps(y + r * ldy, columns, _mm512_add_ps(acc[r], bias));
    }
  }
};
