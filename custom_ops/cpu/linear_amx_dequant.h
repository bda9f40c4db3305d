// The GEMM micro-kernel for the 8- and 4-bit formats (INT8, Q8_0, Q4_0, Q4_1) on AMX-BF16 for GEMMs of many rows
// (a prefill): each thread dequantizes a tile's weight panels once into bf16 pairs laid out as a BF16 panel
// (tdpbf16ps's B layout, linear_amx_bf16.h), keeps them in its slice of the scratch for every tile of rows of the
// current block (gemm_driver.h walks a block's row tiles panel by panel, so the copy is keyed on the panel), and
// runs amx_bf16_tile on them with x rounded to bf16 as AmxBf16Kernel does. The sums accumulate in tiles over the
// whole depth: no per-group scaling of int32 sums on AVX-512 (what bounds AmxInt8Kernel). Each weight is rounded to
// bf16 (d * q + offset in fp32, then nearest even; INT8: q * its column's scale), x too: a bf16 GEMM's accuracy,
// not Int8DotKernel's bits. Included inside the amx_dequant region of linear_gemm.cc after unroll.h, linear_vnni.h
// (Group), linear_bf16.h and linear_amx_bf16.h; no include guard, nothing from the standard library.

// Where a thread's dequantized panels live: a key (the first panel dequantized and how many), then the panels.
struct DequantizedKey {
  const uint8_t* panel;
  int64_t panels;
};
constexpr int64_t kKeyWords = 16;  // the key's room: the panels start 64 bytes into a 64-byte aligned slice

// A packed panel's weights as a BF16 panel's blocks (`out`: 2 blocks of 64 bytes per word of 4 inputs): group g's
// word w (inputs 4w..4w + 3 of the group, one byte per column and input) becomes blocks 2 (8g + w) and the next,
// lane c of each the pair (w[i][c], w[i + 1][c]) in bf16. A short last INT8 group leaves its missing words' blocks
// as they were: x has no words there.
// Each block's fp32 values are computed in its own order, so that vcvtne2ps2bf16 writes the pairs as they lie: one
// vector the pairs of columns 0..7, one those of 8..15 (lane 2c + e: input 2 * block + e of column c). vpermb takes
// each value's byte to the low byte of its lane and zeroes the rest (AVX512-VBMI, which every AMX CPU has), and the
// columns' scale and offset are permuted to match once a group: d * q + offset rounded as before, bit for bit, with
// 16 vector instructions a word instead of 21 (3 shifts and 4 masks, and a vpermw to interleave each block, against
// 4 vpermb), the group's unpacking of its bytes aside.
template <Format kFormat>
static void dequantize_panel(const uint8_t* panel, int64_t num_groups, int64_t num_words, uint8_t* out) {
  const uint8_t* blocks = panel + FormatTraits<kFormat>::kGeometry.header_bytes;
  const __m512 column_scales = kFormat == Format::kInt8 ? _mm512_loadu_ps(panel) : _mm512_set1_ps(1.0f);
  // Lane 2c + e of a block's half h (columns 8h..8h + 7) takes column 8h + c's scale, and the byte of input
  // 2 * block + e of that column (byte 4 (8h + c) + 2 * block + e of the word).
  const __m512i half_columns[2] = {_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                   _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8)};
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512i byte_of[2][2];  // [block][half]: the source byte of each lane, in its low byte
  for (int block = 0; block < 2; ++block) {
    for (int half = 0; half < 2; ++half) {
      const __m512i column = _mm512_add_epi32(_mm512_srli_epi32(lane, 1), _mm512_set1_epi32(8 * half));
      byte_of[block][half] = _mm512_add_epi32(_mm512_slli_epi32(column, 2),
                                              _mm512_add_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(1)),
                                                               _mm512_set1_epi32(2 * block)));
    }
  }
  constexpr __mmask64 kLowBytes = 0x1111111111111111ull;
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 d, offset;
    __m512 scale[2], shift[2];  // [half], permuted to the blocks' lanes
    Group<kFormat>::words(blocks, g, num_words, d, offset, [&](auto w, __m512i bytes) {
      if constexpr (decltype(w)::value == 0) {  // the group's d and offset are set before its first word
        // INT8's d = 1 and offset = -128 times its column's scale: the exact q times the scale, rounded once.
        const __m512 columns_scale = _mm512_mul_ps(d, column_scales), columns_shift = _mm512_mul_ps(offset, column_scales);
        for (int half = 0; half < 2; ++half) {
          scale[half] = _mm512_permutexvar_ps(half_columns[half], columns_scale);
          shift[half] = _mm512_permutexvar_ps(half_columns[half], columns_shift);
        }
      }
      uint8_t* pairs = out + (g * kGroupWords + decltype(w)::value) * 2 * 64;
      for (int block = 0; block < 2; ++block) {
        __m512 values[2];
        for (int half = 0; half < 2; ++half) {
          const __m512i q = _mm512_maskz_permutexvar_epi8(kLowBytes, byte_of[block][half], bytes);
          values[half] = _mm512_fmadd_ps(scale[half], _mm512_cvtepi32_ps(q), shift[half]);
        }
        _mm512_store_si512(pairs + block * 64, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(values[1], values[0])));
      }
    });
  }
}

// The micro-kernel (gemm_driver.h) of the int8 formats on AMX-BF16: x rounded to bf16 pairs (as Bf16DotKernel
// prepares it), kAmxRows rows by two panels per tile, the panels dequantized once per block of rows and thread.
template <Format kFormat>
struct AmxDequantKernel {
  static constexpr bool kReads = FormatTraits<kFormat>::kDot == Dot::kInt8;
  static constexpr int kTileRows = kAmxRows;
  static constexpr bool kEvenRowTiles = false;
  static constexpr int kMaxPanels = 2;
  static constexpr int64_t kTwoPanelRows = 1;
  // x rows a block holds (gemm_driver.h): each block dequantizes every panel again, so blocks of 1 MiB of x, not
  // 256 KiB (every CPU with AMX so far, Sapphire, Emerald and Granite Rapids, has 2 MiB of L2 a core). Q4_1 down
  // projection (1536 inputs), 512 and 2048 rows, 2 threads, Emerald Rapids: 1.34-1.45x at 1 MiB, 1.21-1.26x at
  // 512 KiB; the other shapes unchanged. (The bf16 kernel measured 0.88-0.94x with 1 MiB: it keeps 256 KiB.)
  static constexpr int64_t kBlockBytes = 1 << 20;

  // x as AmxBf16Kernel and Bf16DotKernel prepare it: bf16 pairs of inputs, one word per block of a BF16 panel.
  using XInput = typename Bf16DotKernel<Format::kBF16>::Input;

  // The packed panel's words (4 inputs each) and groups of them, and the words (uint32) of one dequantized panel
  // (16 per pair of inputs, the padding rows included).
  static int64_t num_x_words(int64_t k) { return num_blocks(Format::kBF16, k); }
  static int64_t num_packed_words(int64_t k) {
    return num_blocks(kFormat, k) * (FormatTraits<kFormat>::kGeometry.block_k / 4);
  }
  static int64_t num_groups(int64_t k) { return (num_packed_words(k) + kGroupWords - 1) / kGroupWords; }
  static int64_t dequantized_panel_words(int64_t k) { return num_groups(k) * kGroupWords * 2 * 16; }
  static int64_t slice_words(int64_t k) { return kKeyWords + 2 * dequantized_panel_words(k); }
  // words: x's rows [m, num_x_words] and kAmxRows rows of slack (a tile loads 16 or 32 rows of x however many are
  // left), room to align, then a slice per thread the GEMM may run on.
  static ScratchSize scratch(int64_t m, int64_t k) {
    return {(m + kAmxRows) * num_x_words(k) + kKeyWords + omp_get_max_threads() * slice_words(k), 0};
  }

  // Rows of x from a tile's first, and the threads' slices.
  struct Rows {
    const uint32_t* words;
    int64_t num_words;
    uint32_t* slices;
    int64_t slice_words, panel_words, num_groups, num_packed_words;
    int64_t packed_panel_bytes;  // of one panel as packed
  };
  // XInput (its prepare and row_bytes), and the threads' slices after x's rows, each key set to none.
  struct Input : XInput {
    uint32_t* slices;
    Input(const float* x, int64_t m, int64_t k, const Scratch& scratch) : XInput(x, m, k, scratch) {
      const uintptr_t end = reinterpret_cast<uintptr_t>(this->words + (m + kAmxRows) * this->num_words);
      slices = reinterpret_cast<uint32_t*>((end + 63) & ~static_cast<uintptr_t>(63));
      for (int t = 0; t < omp_get_max_threads(); ++t) {
        const DequantizedKey none{nullptr, 0};
        __builtin_memcpy(slices + t * slice_words(k), &none, sizeof none);
      }
    }
    Rows rows(int64_t r0) const {
      const int64_t k = this->k;
      return {this->words + r0 * this->num_words, this->num_words, slices, slice_words(k), dequantized_panel_words(k),
              num_groups(k), num_packed_words(k), panel_bytes(kFormat, k)};
    }
  };

  static void start_thread() { load_gemm_tiles(64, kTileRegisterRows); }
  static void finish_thread() { release_tiles(); }

  // The tile's panels dequantized into the thread's slice unless its last tile's were the same, then
  // AmxBf16Kernel's tile on them, asking for the next tile's packed panels (`ahead`, the first tile of rows: its
  // dequantization then reads them from L2) over its loop. Decode of 64 sequences, SmolLM2, Emerald Rapids,
  // 2 threads (bench_worker.py, two runs each): gguf step 33.7, 33.4 -> 30.2, 30.7 ms (linear 15.5, 15.1 -> 13.2,
  // 14.2; lm_head, Q8_0, 5.0, 5.4 -> 3.7, 4.0), int8 34.1, 33.8 -> 33.1, 32.7.
  template <int kRows, int kPanels, bool kSiluMul>
  static inline void tile(const Rows& rows, const uint8_t* panel, int64_t panel_bytes, const float* start, float* y,
                          int64_t ldy, int cols, const uint8_t* ahead, bool) {
    uint32_t* slice = rows.slices + omp_get_thread_num() * rows.slice_words;
    uint8_t* dequantized = reinterpret_cast<uint8_t*>(slice + kKeyWords);
    const int64_t dequantized_bytes = rows.panel_words * 4;
    DequantizedKey key;
    __builtin_memcpy(&key, slice, sizeof key);
    if (key.panel != panel || key.panels != kPanels) {
      for (int p = 0; p < kPanels; ++p) {
        dequantize_panel<kFormat>(panel + p * panel_bytes, rows.num_groups, rows.num_packed_words,
                                  dequantized + p * dequantized_bytes);
      }
      key = {panel, kPanels};
      __builtin_memcpy(slice, &key, sizeof key);
    }
    const int64_t chunks = rows.num_words / 16 > 0 ? rows.num_words / 16 : 1;  // of the tile's loop
    amx_bf16_tile<kPanels, kSiluMul>(rows.words, rows.num_words, kRows, dequantized, dequantized_bytes, start, y, ldy,
                                     cols, ahead, panel_bytes, (rows.packed_panel_bytes / chunks + 63) / 64 * 64);
  }
};
