// The attention's micro-kernels for a bf16 or fp8 e4m3 cache on AVX512-BF16 (BS_BF16_DOT, kernels_avx512_bf16.cc):
// keys scored and values summed by vdpbf16ps on the cache's bf16 pairs as stored, or on an fp8 cache's codes decoded
// to bf16 (DotCache). Elsewhere only declared, for the branches of attention_tile.h that other kernel sets discard.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

#ifdef BS_BF16_DOT
// The caches vdpbf16ps reads (kReads): a bf16 cache as stored, and an fp8 e4m3 cache whose 32 codes become 32 bf16
// words in three instructions (words(): a sign-extension, a shift and a mask; each word is 2^-120 times the code's
// value, KvElement<Fp8E4M3>'s placement 16 bits up). vdpbf16ps reads denormal operands as zero and flushes denormal
// products, so the other operand is scaled to keep the products normal: the query rows are multiplied by kQuery
// before they are rounded to bf16 and the scores by scale() / kQuery after; the probabilities by a value row's scale()
// times kWeight before they are rounded, and the sums by 1 / kWeight after. An fp8 code of exponent 0 (a subnormal:
// under 2^-6, 1/28672 of its row's largest value) decodes to a denormal and counts as zero, far below the rounding
// of the row's larger codes (1/16 of a value). For fp8 scores against fp32 FMAs on the widened codes, see
// docs/worker.md.
template <class Cache>
struct DotCache {
  static constexpr bool kReads = false;
  static constexpr float kQuery = 1.0f, kWeight = 1.0f;
};
template <>
struct DotCache<Bf16> {
  static constexpr bool kReads = true;
  static constexpr float kQuery = 1.0f, kWeight = 1.0f;
  static inline __m512i words(const Bf16* p) { return _mm512_loadu_si512(p); }
};
template <>
struct DotCache<Fp8E4M3> {
  static constexpr bool kReads = true;
  // Scores: (q * 2^64) * (v * 2^-120) * (s * 2^120) / 2^64 = q * v * s (s: the row's scale, scale() = s * 2^120).
  // Values: (p * s * 2^120 * 2^-56) * (v * 2^-120) * 2^56 = p * s * v.
  static constexpr float kQuery = 0x1p64f, kWeight = 0x1p-56f;
  static inline __m512i words(const Fp8E4M3* p) {
    const __m512i codes = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    // The magnitude at bits 4..10, the sign (bits 7..15 of the extended code) at 11..15: keep 4..10 and 15.
    return _mm512_and_si512(_mm512_slli_epi16(codes, 4), _mm512_set1_epi16(static_cast<short>(0x87f0)));
  }
};

// score_rows for a cache vdpbf16ps reads, the query rows given as bf16 pairs (`words`: head_dim / 2 per row; head_dim
// a multiple of 32): vdpbf16ps multiplies a key's bf16 pairs with them and sums in fp32, so a key is not widened
// to fp32 first. A scaled cache's scores are the codes' products summed: the caller multiplies them by each key's
// scale() / kQuery (scale_by_rows).
template <int ROWS, class Cache, class Ahead>
static inline void score_rows_dot(const uint32_t* words, int64_t head_dim, const Cache* const* keys, int64_t num_keys,
                                  float* scores, Ahead& ahead) {
  const int64_t row_words = head_dim / 2;
  for (int64_t j = 0; j < num_keys; j += 4) {
    ahead();
    reg acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = Vec::zero();
    for (int64_t w = 0; w < row_words; w += 16) {
      __m512bh qv[ROWS];
      for (int r = 0; r < ROWS; ++r) qv[r] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(words + r * row_words + w));
      for (int c = 0; c < 4; ++c) {
        const __m512bh k = reinterpret_cast<__m512bh>(DotCache<Cache>::words(keys[j + c] + 2 * w));
        for (int r = 0; r < ROWS; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv[r], k);
      }
    }
    for (int r = 0; r < ROWS; ++r) Vec::hsum4_store(acc[r][0], acc[r][1], acc[r][2], acc[r][3], scores + r * kKeySpan + j);
  }
}

#include "bf16_pairs.h"  // to_bf16_pairs: the query rows and the probabilities as vdpbf16ps operands

// accumulate_values for a cache vdpbf16ps reads (head_dim a multiple of 32): the probabilities rounded to bf16 pairs
// of consecutive keys (a scaled cache's folded with the values' scale() * kWeight first), and two keys' values
// interleaved into bf16 pairs (vpunpck{l,h}wd), so that vdpbf16ps adds both keys' products at once. The accumulators
// hold each 32 dims of the head permuted (store_unpermuted puts them back): lane 4L + i of the first 16 is dim
// 8L + i, of the second 16 dim 8L + 4 + i. ahead() is called once per 2 pairs of keys and 32 dims.
template <int ROWS, class Cache, class Ahead>
static inline void accumulate_values_dot(float* acc, const float* probs, const Cache* const* values, int64_t num_keys,
                                         int64_t head_dim, Ahead& ahead) {
  uint32_t pairs[ROWS][kKeySpan / 2];
  for (int r = 0; r < ROWS; ++r) to_bf16_pairs(probs + r * kKeySpan, num_keys, pairs[r]);
  const int64_t num_pairs = (num_keys + 1) / 2;
  for (int64_t d = 0; d < head_dim; d += 32) {
    reg a[ROWS][2];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) a[r][0] = Vec::load(acc + r * head_dim + d), a[r][1] = Vec::load(acc + r * head_dim + d + 16);
    for (int64_t p = 0; p < num_pairs; ++p) {
      if (p % 2 == 0) ahead();
      const Cache* first = values[2 * p];
      const Cache* second = 2 * p + 1 < num_keys ? values[2 * p + 1] : first;  // its probability is 0
      const __m512i x = DotCache<Cache>::words(first + d), y = DotCache<Cache>::words(second + d);
      const __m512bh low = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(x, y));
      const __m512bh high = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(x, y));
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        a[r][0] = dot_broadcast(a[r][0], low, &pairs[r][p]);
        a[r][1] = dot_broadcast(a[r][1], high, &pairs[r][p]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) Vec::store(acc + r * head_dim + d, a[r][0]), Vec::store(acc + r * head_dim + d + 16, a[r][1]);
  }
}

// accumulate_values_dot for ROWS rows of HEADS adjacent kv heads at once (accs[h], probs[h]: head h's rows),
// so that each slot's heads, adjacent in the cache, are read together; key j's head h is at
// head_values + slot_offsets[j] + h * row (row: elements from one row to the next). ahead() is called once per 2
// pairs of keys and 32 dims. Not inlined: inlined into attend_tile_with, GCC kept the 18 accumulators of 3 rows of 3
// heads on the stack across the loop after an unrelated change (a bf16 decode tile 1.15-1.25x slower, one thread,
// bench_attention_tile.py); on its own it keeps them in registers.
template <int ROWS, int HEADS, class Cache, class Ahead>
__attribute__((noinline)) static void accumulate_values_by_slot(float* const* accs, const float* const* probs,
                                                                const Cache* head_values, const int64_t* slot_offsets,
                                                                int64_t num_keys, int64_t head_dim, int64_t row,
                                                                Ahead& ahead) {
  uint32_t pairs[HEADS][ROWS][kKeySpan / 2];
  for (int h = 0; h < HEADS; ++h)
    for (int r = 0; r < ROWS; ++r) to_bf16_pairs(probs[h] + r * kKeySpan, num_keys, pairs[h][r]);
  const int64_t num_pairs = (num_keys + 1) / 2;
  for (int64_t d = 0; d < head_dim; d += 32) {
    reg a[HEADS][ROWS][2];
#pragma GCC unroll 4
    for (int h = 0; h < HEADS; ++h)
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r)
        a[h][r][0] = Vec::load(accs[h] + r * head_dim + d), a[h][r][1] = Vec::load(accs[h] + r * head_dim + d + 16);
    for (int64_t p = 0; p < num_pairs; ++p) {
      if (p % 2 == 0) ahead();
      const Cache* first = head_values + slot_offsets[2 * p] + d;
      const Cache* second = 2 * p + 1 < num_keys ? head_values + slot_offsets[2 * p + 1] + d : first;  // probability 0
#pragma GCC unroll 4
      for (int h = 0; h < HEADS; ++h) {
        const __m512i x = DotCache<Cache>::words(first + h * row), y = DotCache<Cache>::words(second + h * row);
        const __m512bh low = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(x, y));
        const __m512bh high = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(x, y));
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
          a[h][r][0] = dot_broadcast(a[h][r][0], low, &pairs[h][r][p]);
          a[h][r][1] = dot_broadcast(a[h][r][1], high, &pairs[h][r][p]);
        }
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HEADS; ++h)
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r)
        Vec::store(accs[h] + r * head_dim + d, a[h][r][0]), Vec::store(accs[h] + r * head_dim + d + 16, a[h][r][1]);
  }
}

// r[i] (16 dwords each) becomes the transpose: r[w] lane i = the old r[i] lane w.
static inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);      // per 128-bit lane L: elements 4L, 4L + 1
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);  // elements 4L + 2, 4L + 3
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e], lane L: element 4L + e of rows 4i..4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // element 4L + e: lane L of r[e], r[4 + e], r[8 + e], r[12 + e]
    const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88), d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xdd);
    t[e] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[8 + e] = _mm512_shuffle_i32x4(a, c, 0xdd);
    t[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(b, d, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// rows[0..num_keys) (of a cache DotCache reads; head_dim a multiple of 32) as bf16 words, head_dim apart from `out`:
// a prompt's span of values decoded once for all its rows.
template <class Cache>
static inline void rows_as_words(const Cache* const* rows, int64_t num_keys, int64_t head_dim, Bf16* out) {
  for (int64_t j = 0; j < num_keys; ++j) {
    for (int64_t d = 0; d < head_dim; d += 32) {
      _mm512_storeu_si512(out + j * head_dim + d, DotCache<Cache>::words(rows[j] + d));
    }
  }
}

// Keys in lanes: kt[w * kKeySpan + j] = word w (the bf16 pair of dims 2w, 2w + 1) of key j, for num_keys keys (a
// multiple of 16; head_dim a multiple of 32), so that one vdpbf16ps scores 16 keys for a row against its
// broadcast query word, with no horizontal sum. Rewritten once per span, shared by all the rows of a prefill tile.
template <class Cache>
static inline void keys_in_lanes(const Cache* const* keys, int64_t num_keys, int64_t head_dim, uint32_t* kt) {
  for (int64_t j = 0; j < num_keys; j += 16) {
    for (int64_t w = 0; w < head_dim / 2; w += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = DotCache<Cache>::words(keys[j + i] + 2 * w);
      transpose_16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (w + i) * kKeySpan + j, r[i]);
    }
  }
}

// scores[r * kKeySpan + j0 + j] = q_r . k_(j0 + j) for ROWS rows (bf16 words, row_words each) and 16 * VECS keys in
// lanes (kt), times key_scales[j0 + j] where given (a scaled cache's: its codes' products summed); ahead() is called
// as often as score_rows_dot calls it for as many rows and keys.
template <int ROWS, int VECS, class Ahead>
static inline void score_rows_in_lanes(const uint32_t* words, int64_t row_words, const uint32_t* kt, int64_t j0,
                                       const float* key_scales, float* scores, Ahead& ahead) {
  for (int i = 0; i < (ROWS + 2) / 3 * 4 * VECS; ++i) ahead();
  __m512 acc[ROWS][VECS];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t w = 0; w < row_words; ++w) {
    __m512bh k[VECS];
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) k[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt + w * kKeySpan + j0 + 16 * c));
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
      for (int c = 0; c < VECS; ++c) acc[r][c] = dot_broadcast(acc[r][c], k[c], &words[r * row_words + w]);
    }
  }
  if (key_scales != nullptr) {
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) {
      const reg scale = Vec::load(key_scales + j0 + 16 * c);
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) acc[r][c] = Vec::mul(acc[r][c], scale);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) Vec::store(scores + r * kKeySpan + j0 + 16 * c, acc[r][c]);
}

template <int ROWS, class Ahead>
static inline void score_block_in_lanes(const uint32_t* words, int64_t row_words, const uint32_t* kt, int64_t num_keys,
                                        const float* key_scales, float* scores, Ahead& ahead) {
  int64_t j = 0;
  for (; j + 64 <= num_keys; j += 64) score_rows_in_lanes<ROWS, 4>(words, row_words, kt, j, key_scales, scores, ahead);
  if (num_keys - j >= 32) score_rows_in_lanes<ROWS, 2>(words, row_words, kt, j, key_scales, scores, ahead), j += 32;
  if (num_keys - j >= 16) score_rows_in_lanes<ROWS, 1>(words, row_words, kt, j, key_scales, scores, ahead);
}

// The scores of rows [first_row, rows) of one kv head (its queries as bf16 words, dim / 2 per row) for num_keys
// keys in lanes (a multiple of 16), 6 rows at a time: 24 accumulators, each 16-key load of kt feeding 6 vdpbf16ps;
// times key_scales[j] where given (a scaled cache's).
template <class Ahead>
static inline void score_span_in_lanes(const uint32_t* words, int64_t first_row, int64_t rows, int64_t dim,
                                       const uint32_t* kt, int64_t num_keys, float* scores, Ahead& ahead,
                                       const float* key_scales = nullptr) {
  const int64_t row_words = dim / 2;
  for (int64_t r = first_row; r < rows; r += 6) {
    with_rows<6>(static_cast<int>(rows - r < 6 ? rows - r : 6), [&](auto count) {
      score_block_in_lanes<decltype(count)::value>(words + r * row_words, row_words, kt, num_keys, key_scales,
                                                   scores + r * kKeySpan, ahead);
    });
  }
}

// dst[0..head_dim) = acc (accumulate_values_dot's order) * scale, in the head's order.
static inline void store_unpermuted(const float* acc, float scale, int64_t head_dim, float* dst) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const reg s = Vec::set1(scale);
  for (int64_t d = 0; d < head_dim; d += 32) {
    const reg low = Vec::load(acc + d), high = Vec::load(acc + d + 16);
    Vec::store(dst + d, Vec::mul(_mm512_permutex2var_ps(low, first, high), s));
    Vec::store(dst + d + 16, Vec::mul(_mm512_permutex2var_ps(low, second, high), s));
  }
}

#else
// Declared for attend_rows' discarded branch; only the AVX512-BF16 kernels define and use it.
template <class Cache>
struct DotCache {
  static constexpr bool kReads = false;
  static constexpr float kQuery = 1.0f, kWeight = 1.0f;
};
template <int ROWS, class Cache, class Ahead>
void score_rows_dot(const uint32_t* words, int64_t head_dim, const Cache* const* keys, int64_t num_keys, float* scores,
                    Ahead& ahead);
void to_bf16_pairs(const float* x, int64_t n, uint32_t* words);
template <int ROWS, class Cache, class Ahead>
void accumulate_values_dot(float* acc, const float* probs, const Cache* const* values, int64_t num_keys,
                           int64_t head_dim, Ahead& ahead);
template <int ROWS, int HEADS, class Cache, class Ahead>
void accumulate_values_by_slot(float* const* accs, const float* const* probs, const Cache* head_values,
                               const int64_t* slot_offsets, int64_t num_keys, int64_t head_dim, int64_t row,
                               Ahead& ahead);
void store_unpermuted(const float* acc, float scale, int64_t head_dim, float* dst);
template <class Cache>
void keys_in_lanes(const Cache* const* keys, int64_t num_keys, int64_t head_dim, uint32_t* kt);
template <class Cache>
void rows_as_words(const Cache* const* rows, int64_t num_keys, int64_t head_dim, Bf16* out);
template <class Ahead>
void score_span_in_lanes(const uint32_t* words, int64_t first_row, int64_t rows, int64_t dim, const uint32_t* kt,
                         int64_t num_keys, float* scores, Ahead& ahead, const float* key_scales = nullptr);
#endif
