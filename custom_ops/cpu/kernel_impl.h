// The kernels, written once over `Vec` (simd_avx2.h or simd_avx512.h). Included by
// kernels_avx2.cc and kernels_avx512.cc inside their `#pragma GCC target` regions and
// namespaces; no include guard on purpose. Only builtins and own code here: an inline
// library function instantiated in this region would be compiled for the region's ISA.

using reg = Vec::reg;
constexpr int W = Vec::W;

#include "vector_exp.h"  // vexp, silu_times

static inline float sexp(float x) { return __builtin_expf(x); }

// One value as the cache stores it: itself, or rounded to bf16 (nearest even; inputs are finite).
template <class Out>
static inline Out to_cache(float x);
template <>
inline float to_cache<float>(float x) {
  return x;
}
template <>
inline bf16 to_cache<bf16>(float x) {
  unsigned bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  return static_cast<bf16>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static void rms_norm_row(const float* x, const float* residual, const float* weight, float* out, float* summed,
                         int64_t width, float eps) {
  const int64_t full = width - width % W;
  reg squares = Vec::zero();
  float tail_squares = 0.0f;
  const float* source = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < full; i += W) {
      reg v = Vec::add(Vec::load(x + i), Vec::load(residual + i));
      Vec::store(summed + i, v);
      squares = Vec::fmadd(v, v, squares);
    }
    for (int64_t i = full; i < width; ++i) {
      summed[i] = x[i] + residual[i];
      tail_squares += summed[i] * summed[i];
    }
    source = summed;
  } else {
    for (int64_t i = 0; i < full; i += W) squares = Vec::fmadd(Vec::load(x + i), Vec::load(x + i), squares);
    for (int64_t i = full; i < width; ++i) tail_squares += x[i] * x[i];
  }
  const float mean = (Vec::reduce_add(squares) + tail_squares) / static_cast<float>(width);
  const float inv_rms = 1.0f / __builtin_sqrtf(mean + eps);
  const reg inv = Vec::set1(inv_rms);
  for (int64_t i = 0; i < full; i += W) {
    Vec::store(out + i, Vec::mul(Vec::mul(Vec::load(source + i), inv), Vec::load(weight + i)));
  }
  for (int64_t i = full; i < width; ++i) out[i] = source[i] * inv_rms * weight[i];
}

static void silu_and_mul_row(const float* gate_up, float* out, int64_t width) {
  const int64_t full = width - width % W;
  for (int64_t i = 0; i < full; i += W) {
    Vec::store(out + i, silu_times(Vec::load(gate_up + i), Vec::load(gate_up + width + i)));
  }
  for (int64_t i = full; i < width; ++i) {
    const float gate = gate_up[i];
    out[i] = gate / (1.0f + sexp(-gate)) * gate_up[width + i];
  }
}

// The largest of x[0..width), NaNs left out (-inf for a row of NaNs).
static float row_max(const float* x, int64_t width) {
  const int64_t full = width - width % W;
  reg maxes = Vec::set1(-__builtin_inff());
  for (int64_t i = 0; i < full; i += W) maxes = Vec::max(Vec::load(x + i), maxes);  // a NaN lane keeps `maxes`
  float best = Vec::reduce_max(maxes);
  for (int64_t i = full; i < width; ++i) best = x[i] > best ? x[i] : best;
  return best;
}

// The index of the largest of x[0..width): the first if tied; NaNs never win (an all-NaN row gives 0).
static int64_t argmax_row(const float* x, int64_t width) {
  const int64_t full = width - width % W;
  const float best = row_max(x, width);
  for (int64_t i = 0; i < full; i += W) {
    const int lane = Vec::first_equal(Vec::load(x + i), best);
    if (lane >= 0) return i + lane;
  }
  for (int64_t i = full; i < width; ++i) {
    if (x[i] == best) return i;
  }
  return 0;
}

// The masses of a row's draw (KernelSet::draw_masses), and the sums of each kDrawGroup of them.
static double draw_masses(const float* x, int64_t width, float temperature, float min_p, float* masses,
                          float* group_sums) {
  static_assert(kDrawGroup % W == 0, "a group is whole vectors");
  const int64_t full = width - width % kDrawGroup;
  const float shift = row_max(x, width) / temperature;  // = the largest x / temperature: division rounds monotonically
  const float at_least = min_p > kMinDrawnMass ? min_p : kMinDrawnMass;  // the largest entry's mass is 1
  const reg t = Vec::set1(temperature), s = Vec::set1(shift), floor = Vec::set1(at_least);
  double total = 0.0;
  int64_t g = 0;
  for (int64_t i = 0; i < full; i += kDrawGroup, ++g) {
    reg sum = Vec::zero();
    for (int64_t v = i; v < i + kDrawGroup; v += W) {
      const reg mass = Vec::keep_at_least(vexp(Vec::sub(Vec::div(Vec::load(x + v), t), s)), floor);
      Vec::store(masses + v, mass);
      sum = Vec::add(sum, mass);
    }
    group_sums[g] = Vec::reduce_add(sum);
    total += group_sums[g];
  }
  if (full < width) {
    float tail = 0.0f;
    for (int64_t i = full; i < width; ++i) {
      const float mass = sexp(x[i] / temperature - shift);
      masses[i] = mass >= at_least ? mass : 0.0f;
      tail += masses[i];
    }
    group_sums[g] = tail;
    total += tail;
  }
  return total;
}

// Rotary embedding of one head into the query (fp32) or the cache (Out = float or bf16).
template <class Out>
static void rotate_head_to(const float* x, const float* cos, const float* sin, Out* out, int64_t head_dim) {
  const int64_t half = head_dim / 2, full = half - half % W;
  for (int64_t i = 0; i < full; i += W) {
    reg x1 = Vec::load(x + i), x2 = Vec::load(x + half + i), c = Vec::load(cos + i), s = Vec::load(sin + i);
    Vec::store(out + i, Vec::sub(Vec::mul(x1, c), Vec::mul(x2, s)));
    Vec::store(out + half + i, Vec::fmadd(x1, s, Vec::mul(x2, c)));
  }
  for (int64_t i = full; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    out[i] = to_cache<Out>(x1 * cos[i] - x2 * sin[i]);
    out[half + i] = to_cache<Out>(x2 * cos[i] + x1 * sin[i]);
  }
}

static void rotate_head(const float* x, const float* cos, const float* sin, float* out, int64_t head_dim) {
  rotate_head_to(x, cos, sin, out, head_dim);
}

static void rotate_head_bf16(const float* x, const float* cos, const float* sin, bf16* out, int64_t head_dim) {
  rotate_head_to(x, cos, sin, out, head_dim);
}

static void store_bf16(const float* x, bf16* out, int64_t width) {
  const int64_t full = width - width % W;
  for (int64_t i = 0; i < full; i += W) Vec::store(out + i, Vec::load(x + i));
  for (int64_t i = full; i < width; ++i) out[i] = to_cache<bf16>(x[i]);
}

// scores[r * kKeySpan + j] = q_r . k_j for ROWS query rows and num_keys (a multiple of 4) keys;
// ahead() is called once per group of 4 keys (it asks for the cache lines of work to come).
template <int ROWS, class Cache, class Ahead>
static inline void score_rows(const float* q, int64_t head_dim, const Cache* const* keys, int64_t num_keys,
                              float* scores, Ahead& ahead) {
  for (int64_t j = 0; j < num_keys; j += 4) {
    ahead();
    reg acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = Vec::zero();
    for (int64_t d = 0; d < head_dim; d += W) {
      reg qv[ROWS];
      for (int r = 0; r < ROWS; ++r) qv[r] = Vec::load(q + r * head_dim + d);
      for (int c = 0; c < 4; ++c) {
        reg k = Vec::load(keys[j + c] + d);
        for (int r = 0; r < ROWS; ++r) acc[r][c] = Vec::fmadd(qv[r], k, acc[r][c]);
      }
    }
    for (int r = 0; r < ROWS; ++r) Vec::hsum4_store(acc[r][0], acc[r][1], acc[r][2], acc[r][3], scores + r * kKeySpan + j);
  }
}

#ifdef BS_BF16_DOT
// score_rows for a bf16 cache, the query rows given as bf16 pairs (`words`: head_dim / 2 per row; head_dim
// a multiple of 32): vdpbf16ps multiplies a key's raw bf16 pairs with them and sums in fp32, so a key is
// not widened first.
template <int ROWS, class Ahead>
static inline void score_rows_dot(const uint32_t* words, int64_t head_dim, const bf16* const* keys, int64_t num_keys,
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
        const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(keys[j + c] + 2 * w));
        for (int r = 0; r < ROWS; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv[r], k);
      }
    }
    for (int r = 0; r < ROWS; ++r) Vec::hsum4_store(acc[r][0], acc[r][1], acc[r][2], acc[r][3], scores + r * kKeySpan + j);
  }
}

#include "bf16_pairs.h"  // to_bf16_pairs: the query rows and the probabilities as vdpbf16ps operands

// accumulate_values for a bf16 cache (head_dim a multiple of 32): the probabilities rounded to bf16 pairs of
// consecutive keys, and two keys' values interleaved into bf16 pairs (vpunpck{l,h}wd), so that vdpbf16ps
// adds both keys' products at once. The accumulators hold each 32 dims of the head permuted
// (store_unpermuted puts them back): lane 4L + i of the first 16 is dim 8L + i, of the second 16 dim 8L + 4 + i.
// ahead() is called once per 2 pairs of keys and 32 dims.
template <int ROWS, class Ahead>
static inline void accumulate_values_dot(float* acc, const float* probs, const bf16* const* values, int64_t num_keys,
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
      const bf16* first = values[2 * p];
      const bf16* second = 2 * p + 1 < num_keys ? values[2 * p + 1] : first;  // its probability is 0
      const __m512i x = _mm512_loadu_si512(first + d), y = _mm512_loadu_si512(second + d);
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
// head_values + slot_offsets[j] + h * head_dim. ahead() is called once per 2 pairs of keys and 32 dims.
template <int ROWS, int HEADS, class Ahead>
static inline void accumulate_values_by_slot(float* const* accs, const float* const* probs, const bf16* head_values,
                                             const int64_t* slot_offsets, int64_t num_keys, int64_t head_dim,
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
      const bf16* first = head_values + slot_offsets[2 * p] + d;
      const bf16* second = 2 * p + 1 < num_keys ? head_values + slot_offsets[2 * p + 1] + d : first;  // probability 0
#pragma GCC unroll 4
      for (int h = 0; h < HEADS; ++h) {
        const __m512i x = _mm512_loadu_si512(first + h * head_dim), y = _mm512_loadu_si512(second + h * head_dim);
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

// Keys in lanes: kt[w * kKeySpan + j] = word w (the bf16 pair of dims 2w, 2w + 1) of key j, for num_keys keys (a
// multiple of 16; head_dim a multiple of 32), so that one vdpbf16ps scores 16 keys for a row against its
// broadcast query word, with no horizontal sum. Rewritten once per span, shared by all the rows of a prefill tile.
static inline void keys_in_lanes(const bf16* const* keys, int64_t num_keys, int64_t head_dim, uint32_t* kt) {
  for (int64_t j = 0; j < num_keys; j += 16) {
    for (int64_t w = 0; w < head_dim / 2; w += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(keys[j + i] + 2 * w);
      transpose_16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (w + i) * kKeySpan + j, r[i]);
    }
  }
}

// scores[r * kKeySpan + j0 + j] = q_r . k_(j0 + j) for ROWS rows (bf16 words, row_words each) and 16 * VECS keys in
// lanes (kt); ahead() is called as often as score_rows_dot calls it for as many rows and keys.
template <int ROWS, int VECS, class Ahead>
static inline void score_rows_in_lanes(const uint32_t* words, int64_t row_words, const uint32_t* kt, int64_t j0,
                                       float* scores, Ahead& ahead) {
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
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) Vec::store(scores + r * kKeySpan + j0 + 16 * c, acc[r][c]);
}

template <int ROWS, class Ahead>
static inline void score_block_in_lanes(const uint32_t* words, int64_t row_words, const uint32_t* kt, int64_t num_keys,
                                        float* scores, Ahead& ahead) {
  int64_t j = 0;
  for (; j + 64 <= num_keys; j += 64) score_rows_in_lanes<ROWS, 4>(words, row_words, kt, j, scores, ahead);
  if (num_keys - j >= 32) score_rows_in_lanes<ROWS, 2>(words, row_words, kt, j, scores, ahead), j += 32;
  if (num_keys - j >= 16) score_rows_in_lanes<ROWS, 1>(words, row_words, kt, j, scores, ahead);
}

// The scores of rows [first_row, rows) of one kv head (its queries as bf16 words, dim / 2 per row) for num_keys
// keys in lanes (a multiple of 16), 6 rows at a time: 24 accumulators, each 16-key load of kt feeding 6 vdpbf16ps.
template <class Ahead>
static inline void score_span_in_lanes(const uint32_t* words, int64_t first_row, int64_t rows, int64_t dim,
                                       const uint32_t* kt, int64_t num_keys, float* scores, Ahead& ahead) {
  const int64_t row_words = dim / 2;
  for (int64_t r = first_row; r < rows; r += 6) {
    with_rows<6>(static_cast<int>(rows - r < 6 ? rows - r : 6), [&](auto count) {
      score_block_in_lanes<decltype(count)::value>(words + r * row_words, row_words, kt, num_keys,
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
template <int ROWS, class Ahead>
void score_rows_dot(const uint32_t* words, int64_t head_dim, const bf16* const* keys, int64_t num_keys, float* scores,
                    Ahead& ahead);
void to_bf16_pairs(const float* x, int64_t n, uint32_t* words);
template <int ROWS, class Ahead>
void accumulate_values_dot(float* acc, const float* probs, const bf16* const* values, int64_t num_keys, int64_t head_dim,
                           Ahead& ahead);
template <int ROWS, int HEADS, class Ahead>
void accumulate_values_by_slot(float* const* accs, const float* const* probs, const bf16* head_values,
                               const int64_t* slot_offsets, int64_t num_keys, int64_t head_dim, Ahead& ahead);
void store_unpermuted(const float* acc, float scale, int64_t head_dim, float* dst);
void keys_in_lanes(const bf16* const* keys, int64_t num_keys, int64_t head_dim, uint32_t* kt);
template <class Ahead>
void score_span_in_lanes(const uint32_t* words, int64_t first_row, int64_t rows, int64_t dim, const uint32_t* kt,
                         int64_t num_keys, float* scores, Ahead& ahead);
#endif

// acc_r[0..head_dim) += sum_j probs_r[j] * values[j] for ROWS rows at once: each value vector is loaded
// once for all rows. CHUNK vectors of the head per pass keep ROWS * CHUNK accumulators in registers.
// ahead() is called once per 4 keys of a pass.
template <int ROWS>
constexpr int kValueChunk = W == 16 ? 4 : ROWS == 1 ? 4 : 2;
template <int ROWS, class Cache, class Ahead>
static inline void accumulate_values(float* acc, const float* probs, const Cache* const* values, int64_t num_keys,
                                     int64_t head_dim, Ahead& ahead) {
  constexpr int CHUNK = kValueChunk<ROWS>;
  int64_t d = 0;
  for (; d + CHUNK * W <= head_dim; d += CHUNK * W) {
    reg a[ROWS][CHUNK];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < CHUNK; ++c) a[r][c] = Vec::load(acc + r * head_dim + d + c * W);
    for (int64_t j = 0; j < num_keys; ++j) {
      if (j % 4 == 0) ahead();
      reg v[CHUNK];
      for (int c = 0; c < CHUNK; ++c) v[c] = Vec::load(values[j] + d + c * W);
      for (int r = 0; r < ROWS; ++r) {
        const reg p = Vec::set1(probs[r * kKeySpan + j]);
        for (int c = 0; c < CHUNK; ++c) a[r][c] = Vec::fmadd(p, v[c], a[r][c]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < CHUNK; ++c) Vec::store(acc + r * head_dim + d + c * W, a[r][c]);
  }
  for (; d < head_dim; d += W) {
    for (int r = 0; r < ROWS; ++r) {
      reg a = Vec::load(acc + r * head_dim + d);
      for (int64_t j = 0; j < num_keys; ++j) a = Vec::fmadd(Vec::set1(probs[r * kKeySpan + j]), Vec::load(values[j] + d), a);
      Vec::store(acc + r * head_dim + d, a);
    }
  }
}

// One online-softmax update of row `scores[0..visible)`: scores become probabilities (zero from `visible`
// to `padded`), the running max, sum and the row's accumulator are rescaled when the max grows. A row's last
// partial vector is computed whole (scores has room: a row is kKeySpan floats) with its lanes from `visible`
// masked, so that a causal diagonal's rows do not take up to W - 1 scalar exps each.
static_assert(kKeySpan % W == 0, "a row of scores is whole vectors");
static inline void softmax_update(float* scores, int64_t visible, int64_t padded, float* running_max,
                                  float* running_sum, float* acc, int64_t head_dim) {
  const int64_t full = visible - visible % W;
  const int tail = static_cast<int>(visible - full);
  float new_max = *running_max;
  if (visible > 0) {
    const reg lowest = Vec::set1(-__builtin_inff());
    reg maxes = lowest;
    for (int64_t j = 0; j < full; j += W) maxes = Vec::max(maxes, Vec::load(scores + j));
    if (tail > 0) maxes = Vec::max(maxes, Vec::first_lanes(Vec::load(scores + full), tail, lowest));
    const float vector_max = Vec::reduce_max(maxes);
    new_max = vector_max > new_max ? vector_max : new_max;
  }
  const reg shift = Vec::set1(new_max);
  reg sums = Vec::zero();
  for (int64_t j = 0; j < full; j += W) {
    reg p = vexp(Vec::sub(Vec::load(scores + j), shift));
    Vec::store(scores + j, p);
    sums = Vec::add(sums, p);
  }
  int64_t zero_from = full;
  if (tail > 0) {
    reg p = Vec::first_lanes(vexp(Vec::sub(Vec::load(scores + full), shift)), tail, Vec::zero());
    Vec::store(scores + full, p);
    sums = Vec::add(sums, p);
    zero_from = full + W;
  }
  const float sum = Vec::reduce_add(sums);
  for (int64_t j = zero_from; j < padded; ++j) scores[j] = 0.0f;
  if (new_max > *running_max) {
    const float correction = sexp(*running_max - new_max);  // 0 on the first span (max = -inf)
    const reg c = Vec::set1(correction);
    for (int64_t d = 0; d < head_dim; d += W) Vec::store(acc + d, Vec::mul(Vec::load(acc + d), c));
    *running_sum *= correction;
    *running_max = new_max;
  }
  *running_sum += sum;
}

// An ahead() that asks for nothing.
struct NoAsks {
  inline void operator()() {}
};

// One kv head's rows of a tile: its queries (scaled), accumulators and running softmax state.
struct HeadRows {
  float* q;             // [rows, dim]; with kDot [rows, dim / 2] bf16 words
  float* acc;           // [rows, dim]
  float* running_max;   // [rows]
  float* running_sum;   // [rows]
};

// scores[(r + i) * kKeySpan + j] = the scores of ROWS rows (from row r) of one kv head for num_keys keys (a
// multiple of 4); kDot: the rows' queries are bf16 words (score_rows_dot), else floats.
template <int ROWS, bool kDot, class Cache, class Ahead>
static inline void score_head_rows(const HeadRows& head, int64_t r, int64_t dim, const Cache* const* keys,
                                   int64_t num_keys, float* scores, Ahead& ahead) {
  if constexpr (kDot) {
    score_rows_dot<ROWS>(reinterpret_cast<const uint32_t*>(head.q) + r * dim / 2, dim, keys, num_keys,
                         scores + r * kKeySpan, ahead);
  } else {
    score_rows<ROWS>(head.q + r * dim, dim, keys, num_keys, scores + r * kKeySpan, ahead);
  }
}

// How many of a span's keys rows r..r + count of a tile see: each row's (visible[i]), and the most.
template <class Cache>
static inline int64_t visible_keys(const AttentionTile<Cache>& t, int64_t r, int count, int64_t span,
                                   int64_t span_keys, int64_t* visible) {
  const int64_t group = t.num_heads / t.num_kv_heads;
  int64_t most_visible = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t position = t.first_position + (r + i) / group;
    visible[i] = position - span + 1 < span_keys ? position - span + 1 : span_keys;
    most_visible = visible[i] > most_visible ? visible[i] : most_visible;
  }
  return most_visible;
}

// Softmax and values of one span for ROWS consecutive rows (from row r) of one kv head, and their scores
// unless by_slot (score_span_by_slot scored them) or `scored` (score_span_in_lanes did). Values: with kDot &&
// by_slot, values_span_by_slot sums them; other by_slot tiles ask while summing, one-head tiles (prefills, long
// contexts) only while scoring.
template <int ROWS, bool kDot, bool by_slot, class Cache, class Ahead>
static inline void attend_rows(const AttentionTile<Cache>& t, const HeadRows& head, int64_t r, int64_t span,
                               int64_t span_keys, int64_t padded_keys, const Cache* const* keys,
                               const Cache* const* values, float* scores, Ahead& ahead, bool scored = false) {
  const int64_t dim = t.head_dim;
  if constexpr (!by_slot) {
    if (!scored) score_head_rows<ROWS, kDot>(head, r, dim, keys, padded_keys, scores, ahead);
  }
  int64_t visible[ROWS];
  const int64_t most_visible = visible_keys(t, r, ROWS, span, span_keys, visible);
  for (int i = 0; i < ROWS; ++i) {
    softmax_update(scores + (r + i) * kKeySpan, visible[i], most_visible, head.running_max + r + i,
                   head.running_sum + r + i, head.acc + (r + i) * dim, dim);
  }
  if constexpr (!(kDot && by_slot)) {
    NoAsks no_asks;
    auto& value_asks = [&]() -> auto& {
      if constexpr (by_slot) {
        return ahead;
      } else {
        return no_asks;
      }
    }();
    if constexpr (kDot) {
      accumulate_values_dot<ROWS>(head.acc + r * dim, scores + r * kKeySpan, values, most_visible, dim, value_asks);
    } else {
      accumulate_values<ROWS>(head.acc + r * dim, scores + r * kKeySpan, values, most_visible, dim, value_asks);
    }
  }
}

// The scores of a span for every kv head of the tile (head h's rows at scores + h * rows * kKeySpan), a group
// of 4 keys at a time for all heads: slot_offsets[j] (j < padded_keys) locates key j's first head.
template <bool kDot, class Cache, class Ahead>
static inline void score_span_by_slot(const AttentionTile<Cache>& t, const HeadRows* heads,
                                      const int64_t* slot_offsets, int64_t padded_keys, int64_t first_row,
                                      int64_t rows, float* scores, Ahead& ahead) {
  const int64_t dim = t.head_dim;
  for (int64_t j = 0; j < padded_keys; j += 4) {
    for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
      const Cache* keys[4];
      for (int c = 0; c < 4; ++c) keys[c] = t.key_cache + slot_offsets[j + c] + h * dim;
      float* head_scores = scores + h * rows * kKeySpan + j;
      int64_t r = first_row;
      for (; r + 3 <= rows; r += 3) score_head_rows<3, kDot>(heads[h], r, dim, keys, 4, head_scores, ahead);
      if (rows - r == 2) score_head_rows<2, kDot>(heads[h], r, dim, keys, 4, head_scores, ahead);
      if (rows - r == 1) score_head_rows<1, kDot>(heads[h], r, dim, keys, 4, head_scores, ahead);
    }
  }
}

#ifdef BS_BF16_DOT
template <int ROWS, class Ahead>
static inline void values_of_heads(int64_t num_heads, float* const* accs, const float* const* probs,
                                   const bf16* head_values, const int64_t* slot_offsets, int64_t num_keys,
                                   int64_t head_dim, Ahead& ahead) {
  if (num_heads == 3) accumulate_values_by_slot<ROWS, 3>(accs, probs, head_values, slot_offsets, num_keys, head_dim, ahead);
  if (num_heads == 2) accumulate_values_by_slot<ROWS, 2>(accs, probs, head_values, slot_offsets, num_keys, head_dim, ahead);
  if (num_heads == 1) accumulate_values_by_slot<ROWS, 1>(accs, probs, head_values, slot_offsets, num_keys, head_dim, ahead);
}

// The values of a span (its probabilities in `scores`, as score_span_by_slot lays them out) for every kv head
// of the tile, 3 rows of 3 heads at a time: each pair of keys' heads read together.
template <class Ahead>
static inline void values_span_by_slot(const AttentionTile<bf16>& t, const HeadRows* heads,
                                       const int64_t* slot_offsets, int64_t span, int64_t span_keys,
                                       int64_t first_row, int64_t rows, const float* scores, Ahead& ahead) {
  const int64_t dim = t.head_dim;
  for (int64_t r = first_row; r < rows; r += 3) {
    const int count = rows - r < 3 ? static_cast<int>(rows - r) : 3;
    int64_t visible[3];
    const int64_t num_keys = visible_keys(t, r, count, span, span_keys, visible);
    for (int64_t h0 = 0; h0 < t.num_tile_kv_heads; h0 += 3) {
      const int64_t num_heads = t.num_tile_kv_heads - h0 < 3 ? t.num_tile_kv_heads - h0 : 3;
      float* accs[3];
      const float* probs[3];
      for (int64_t i = 0; i < num_heads; ++i) {
        accs[i] = heads[h0 + i].acc + r * dim;
        probs[i] = scores + (h0 + i) * rows * kKeySpan + r * kKeySpan;
      }
      const bf16* head_values = t.value_cache + h0 * dim;
      if (count == 3) values_of_heads<3>(num_heads, accs, probs, head_values, slot_offsets, num_keys, dim, ahead);
      if (count == 2) values_of_heads<2>(num_heads, accs, probs, head_values, slot_offsets, num_keys, dim, ahead);
      if (count == 1) values_of_heads<1>(num_heads, accs, probs, head_values, slot_offsets, num_keys, dim, ahead);
    }
  }
}
#else
template <class Ahead>
void values_span_by_slot(const AttentionTile<bf16>& t, const HeadRows* heads, const int64_t* slot_offsets,
                         int64_t span, int64_t span_keys, int64_t first_row, int64_t rows, const float* scores,
                         Ahead& ahead);
#endif

// Asks for the cache lines of keys [cursor, end_key) of a tile (keys and values of the tile's kv heads,
// adjacent in each slot), a few slots at a time: `step` slots per ask, from where the last ask stopped.
// Every line, keys into L2 (or L1 just before they are scored) and values into L2: at 64 decodes in bf16 (attention
// stage, paired in one process) asking every other line measured 1.52x, both into L1 1.50x, both with the T2
// hint 1.08x, both non-temporal 1.58x.
template <class Cache>
struct SpanPrefetch {
  const AttentionTile<Cache>* tile = nullptr;
  int64_t end_key = 0, cursor = 0, step = 0, bytes = 0;
  int64_t block = 0, within = 0;  // the cursor's block-table entry and slot in it (no division per slot)
  int key_locality = 2;  // keys into L2, or into L1 (3) when they are scored right after

  SpanPrefetch() = default;
  // Keys [from, to) of `of`, asked for in about `asks` asks (0: at once); `into_l1` for the keys.
  SpanPrefetch(const AttentionTile<Cache>* of, int64_t from, int64_t to, int64_t asks, bool into_l1 = false)
      : tile(of), end_key(to), cursor(from), block(from / of->block_size), within(from % of->block_size),
        key_locality(into_l1 ? 3 : 2) {
    step = asks > 0 ? (to - from + asks - 1) / asks : to - from;
    bytes = of->num_tile_kv_heads * of->head_dim * static_cast<int64_t>(sizeof(Cache));
  }
  // The span of `of` from key `span`.
  static SpanPrefetch span_of(const AttentionTile<Cache>* of, int64_t span, int64_t asks, bool into_l1 = false) {
    const int64_t end = of->key_end;
    return SpanPrefetch(of, span, end - span < kKeySpan ? end : span + kKeySpan, asks, into_l1);
  }

  inline void operator()() {
    const int64_t stop = cursor + step < end_key ? cursor + step : end_key;
    for (; cursor < stop; ++cursor) {
      const AttentionTile<Cache>& t = *tile;
      const int64_t slot = t.block_ids[block] * t.block_size + within;
      if (++within == t.block_size) within = 0, ++block;
      const int64_t offset = (slot * t.num_kv_heads + t.kv_head) * t.head_dim;
      const char* key_rows = reinterpret_cast<const char*>(t.key_cache + offset);
      const char* value_rows = reinterpret_cast<const char*>(t.value_cache + offset);
      for (int64_t line = 0; line < bytes; line += 64) {
        if (key_locality == 3) {
          __builtin_prefetch(key_rows + line, 0, 3);
        } else {
          __builtin_prefetch(key_rows + line, 0, 2);
        }
        __builtin_prefetch(value_rows + line, 0, 2);
      }
    }
  }

  // Every slot not yet asked for.
  inline void all() {
    step = end_key - cursor;
    (*this)();
  }

  // Every slot before `key` not yet asked for; the pace of later asks unchanged.
  inline void through(int64_t key) {
    const int64_t pace = step;
    step = key - cursor;
    if (step > 0) (*this)();
    step = pace;
  }
};

// What a tile asks for while it computes: its own keys after its first span (a decode's: one query), then
// the next tile's first span (the thread's next tile), `step` slots per ask, so that both are asked for by
// the end of the tile at about the pace its keys are used, each span while the span before it computes.
// A tile of several queries (a prefill's) asks for each later span at once when it begins, as before
// (spreading them measured no faster there, and the whole-step prefill figures moved the wrong way).
// The pace matters at 64 decodes (bf16 cache, 30 layers, 2 threads of an AMD EPYC Zen 4; attention stage us,
// paired step by step in one process against this pace): no asks 16145 / 8490; the next tile's first span at
// once when the tile begins 13500 / 8081; everything at once 14137 / 8519; 2 slots per ask 11475 / 8887, 4 per
// ask 12189 / 8345; 1 slot every other ask 10117 / 7606; 2 slots every other ask (the same pace) 7531 / 7400.
// Asking faster or slower than the keys are used both lose.
template <class Cache>
struct TileAsks {
  SpanPrefetch<Cache> own, next;
  bool spreads_own = false;

  TileAsks(const AttentionTile<Cache>& t, int64_t num_asks) : spreads_own(t.num_queries == 1) {
    const int64_t second_span = t.key_begin + kKeySpan;
    if (spreads_own && t.key_end > second_span) own = SpanPrefetch<Cache>(&t, second_span, t.key_end, 0);
    if (t.next) next = SpanPrefetch<Cache>::span_of(t.next, t.next->key_begin, 0);
    const int64_t slots = (own.end_key - own.cursor) + (next.end_key - next.cursor);
    own.step = next.step = num_asks > 0 ? (slots + num_asks - 1) / num_asks : slots;
  }

  inline void operator()() {
    if (own.cursor < own.end_key) {
      own();
    } else {
      next();
    }
  }

  // The lines of the tile's span from key `span` not yet asked for (it is about to be scored): the first
  // span's unless the tile before asked for them, a later span's at once, or what a decode's asks left.
  inline void span_begins(const AttentionTile<Cache>& t, int64_t span) {
    if (span == t.key_begin) {
      if (!t.first_span_prefetched) SpanPrefetch<Cache>::span_of(&t, span, 0, true).all();
    } else if (spreads_own) {
      own.through(SpanPrefetch<Cache>::span_of(&t, span, 0).end_key);
    } else {
      SpanPrefetch<Cache>::span_of(&t, span, 0, true).all();
    }
  }

  inline void all() {
    own.all();
    next.all();
  }
};

// Attention of a tile's queries for its kv heads [kv_head, kv_head + num_tile_kv_heads). The keys of
// one span are scattered over the cache (one row per slot and head): each span's slots are asked for
// while the span before computes (TileAsks), every head of the tile at once, so that misses are in flight
// while the arithmetic runs, and each slot's heads are read while they are in cache. A tile's first span is
// asked for while the thread's tile before it computes (t.next of that one): a decode tile's keys then
// arrive while the previous decode computes, instead of between two tiles.
// A tile of several kv heads (a decode's) also asks while it sums values, and goes through each span
// slot by slot: each group of 4 keys is scored for every head, and (kDot) each pair of keys' values summed
// for 3 heads at once, so that a slot's heads, adjacent in the cache, are read together.
// kDot (a bf16 cache with AVX512-BF16, head_dim a multiple of 32): keys scored by score_rows_dot, values summed
// by accumulate_values_dot (accumulate_values_by_slot); a one-head tile of several queries (a prefill's) rewrites
// each span's keys in lanes once and scores all its rows from them (score_span_in_lanes: no horizontal sums;
// prefill 1x512, 30 layers, paired in one process: 0.80x the time of scoring 3 rows at a time by score_rows_dot,
// and summing the values 6 rows at a time instead of 3 measured no faster, 0.82x).
// by_slot: the tile has several kv heads (an instance of its own, so that the one-head tiles' code stays as
// it was).
template <class Cache, bool kDot, bool by_slot>
static void attend_tile_with(const AttentionTile<Cache>& t) {
  const int64_t group = t.num_heads / t.num_kv_heads, dim = t.head_dim;
  const int64_t rows = t.num_queries * group;  // per kv head: row qi * group + i = query qi, head group member i
  float* scores = t.scratch;  // [num_tile_kv_heads, rows, kKeySpan]; without by_slot, [rows, kKeySpan] reused by each head
  float* state = scores + t.num_tile_kv_heads * rows * kKeySpan;
  // [head_dim / 2, kKeySpan]: a prefill span's keys in lanes (keys_in_lanes)
  uint32_t* keys_by_lane = reinterpret_cast<uint32_t*>(state + t.num_tile_kv_heads * rows * (2 * dim + 2));
  HeadRows heads[kMaxTileKvHeads];
  for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
    HeadRows& head = heads[h];
    head.q = state + h * rows * (2 * dim + 2);
    head.acc = head.q + rows * dim;
    head.running_max = head.acc + rows * dim;
    head.running_sum = head.running_max + rows;
    const int64_t kv_head = t.kv_head + h;
    for (int64_t qi = 0; qi < t.num_queries; ++qi) {
      for (int64_t i = 0; i < group; ++i) {
        const float* src = t.query + ((t.first_token + qi) * t.num_heads + kv_head * group + i) * dim;
        float* row = head.q + (qi * group + i) * dim;
        for (int64_t d = 0; d < dim; d += W) Vec::store(row + d, Vec::mul(Vec::load(src + d), Vec::set1(t.scale)));
        // In place: row i's words end before row i + 1's floats begin.
        if constexpr (kDot) to_bf16_pairs(row, dim, reinterpret_cast<uint32_t*>(head.q) + (qi * group + i) * dim / 2);
      }
    }
    for (int64_t i = 0; i < rows * dim; i += W) Vec::store(head.acc + i, Vec::zero());
    for (int64_t r = 0; r < rows; ++r) head.running_max[r] = -__builtin_inff(), head.running_sum[r] = 0.0f;
  }

  int64_t slot_offsets[kKeySpan];  // elements from the cache's start to the slot's first kv head of the tile
  const Cache* keys[kKeySpan];
  const Cache* values[kKeySpan];
  const int64_t num_keys = t.key_end - t.key_begin;
  // About how many times this tile calls ahead() (per group of 4 keys: once scoring, and with by_slot once per
  // value pass): its later spans and the next tile's first span are spread over them.
  const int64_t row_groups = (rows + 2) / 3;
  const int64_t value_passes = kDot ? dim / 32 : dim / (kValueChunk<3> * W);
  const int64_t value_heads = kDot && by_slot ? (t.num_tile_kv_heads + 2) / 3 : t.num_tile_kv_heads;
  const int64_t num_asks =
      row_groups * ((num_keys + 3) / 4) * (t.num_tile_kv_heads + (by_slot ? value_heads * value_passes : 0));
  TileAsks<Cache> ahead(t, num_asks);
  for (int64_t span = t.key_begin; span < t.key_end; span += kKeySpan) {
    const int64_t span_keys = t.key_end - span < kKeySpan ? t.key_end - span : kKeySpan;
    for (int64_t j = 0, block = span / t.block_size, within = span % t.block_size; j < span_keys; ++j) {
      slot_offsets[j] = ((t.block_ids[block] * t.block_size + within) * t.num_kv_heads + t.kv_head) * dim;
      if (++within == t.block_size) within = 0, ++block;  // no division per key
    }
    ahead.span_begins(t, span);  // what was not asked for while the span (or tile) before computed
    const int64_t padded_keys = (span_keys + 3) / 4 * 4;  // extra keys repeat one; their scores are never read
    // Queries before the span see none of it.
    const int64_t first_row = (span > t.first_position ? span - t.first_position : 0) * group;
    if constexpr (by_slot) {
      for (int64_t j = span_keys; j < padded_keys; ++j) slot_offsets[j] = slot_offsets[0];
      score_span_by_slot<kDot>(t, heads, slot_offsets, padded_keys, first_row, rows, scores, ahead);
    }
    for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
      float* head_scores = by_slot ? scores + h * rows * kKeySpan : scores;
      if constexpr (!by_slot) {  // a by_slot tile's keys were scored by score_span_by_slot
        for (int64_t j = 0; j < span_keys; ++j) keys[j] = t.key_cache + slot_offsets[j] + h * dim;
        for (int64_t j = span_keys; j < padded_keys; ++j) keys[j] = keys[0];
      }
      if constexpr (!(kDot && by_slot)) {  // kDot && by_slot: values_span_by_slot sums the values
        for (int64_t j = 0; j < span_keys; ++j) values[j] = t.value_cache + slot_offsets[j] + h * dim;
      }
      bool scored = false;  // every row's scores of the span computed at once, keys in lanes
      if constexpr (kDot && !by_slot) {
        if (t.num_queries > 1) {  // a decode's 3 rows would not pay for rewriting the keys
          const int64_t lane_keys = (span_keys + 15) / 16 * 16;
          for (int64_t j = padded_keys; j < lane_keys; ++j) keys[j] = keys[0];
          keys_in_lanes(keys, lane_keys, dim, keys_by_lane);
          score_span_in_lanes(reinterpret_cast<const uint32_t*>(heads[h].q), first_row, rows, dim, keys_by_lane,
                              lane_keys, head_scores, ahead);
          scored = true;
        }
      }
      int64_t r = first_row;
      for (; r + 3 <= rows; r += 3) {
        attend_rows<3, kDot, by_slot>(t, heads[h], r, span, span_keys, padded_keys, keys, values, head_scores,
                                      ahead, scored);
      }
      if (rows - r == 2) {
        attend_rows<2, kDot, by_slot>(t, heads[h], r, span, span_keys, padded_keys, keys, values, head_scores,
                                      ahead, scored);
      }
      if (rows - r == 1) {
        attend_rows<1, kDot, by_slot>(t, heads[h], r, span, span_keys, padded_keys, keys, values, head_scores,
                                      ahead, scored);
      }
    }
    if constexpr (kDot && by_slot) {
      values_span_by_slot(t, heads, slot_offsets, span, span_keys, first_row, rows, scores, ahead);
    }
  }
  ahead.all();  // what the groups did not ask for (a tile of fewer keys than counted)
  for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
    for (int64_t qi = 0; qi < t.num_queries; ++qi) {
      for (int64_t i = 0; i < group; ++i) {
        const int64_t r = qi * group + i;
        float* dst = t.out + (t.first_token + qi) * t.num_heads * dim + ((t.kv_head + h) * group + i) * dim;
        float scale = 1.0f / heads[h].running_sum[r];
        if (t.partial != nullptr) {  // a split: the sums as they are, and the softmax state to merge them by
          dst = t.partial + (h * rows + r) * (dim + 2);
          dst[dim] = heads[h].running_max[r], dst[dim + 1] = heads[h].running_sum[r];
          scale = 1.0f;
        }
        if constexpr (kDot) {
          store_unpermuted(heads[h].acc + r * dim, scale, dim, dst);
        } else {
          const reg inv = Vec::set1(scale);
          for (int64_t d = 0; d < dim; d += W) Vec::store(dst + d, Vec::mul(Vec::load(heads[h].acc + r * dim + d), inv));
        }
      }
    }
  }
}

template <class Cache, bool kDot = false>
static void attend_tile_of(const AttentionTile<Cache>& t) {
  if (t.num_tile_kv_heads > 1) return attend_tile_with<Cache, kDot, true>(t);
  attend_tile_with<Cache, kDot, false>(t);
}

static void attend_tile(const AttentionTile<float>& tile) { attend_tile_of(tile); }
#ifdef BS_BF16_DOT
static void attend_tile_bf16(const AttentionTile<bf16>& tile) {
  if (tile.head_dim % 32 == 0) return attend_tile_of<bf16, true>(tile);
  attend_tile_of<bf16, false>(tile);
}
#else
static void attend_tile_bf16(const AttentionTile<bf16>& tile) { attend_tile_of(tile); }
#endif

static const KernelSet kKernels = {rms_norm_row, silu_and_mul_row, rotate_head, rotate_head_bf16, store_bf16,
                                   attend_tile,  attend_tile_bf16, argmax_row,  draw_masses};
