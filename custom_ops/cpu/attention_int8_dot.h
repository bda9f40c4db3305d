// The attention's key scores and sums of values for an int8 cache on AVX512-VNNI (BS_INT8_DOT,
// kernels_avx512_bf16.cc): each query row is quantized to int8 codes with a scale of its own, as the cache's rows
// are (kv_types.h), and vpdpbusd multiplies its codes with a key's codes as stored, 64 at a time, summing in int32;
// a prompt's rows are scored from each span's keys regrouped once (score_rows_int8_grouped); the values' weights
// are rounded to 8 bits per span and vpdpbusd sums four keys' values at once (accumulate_values_int8). Elsewhere
// kInt8Dot is false: the generic score_rows and accumulate_values widen each code to fp32.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

#ifdef BS_INT8_DOT
template <class Cache>
constexpr bool kInt8Dot = __is_same(Cache, Int8);

// A query row's codes written over row (the layout below) from its largest magnitude and its floats, 16 at a time:
// vector(d) gives floats d..d + 15 (read before the codes of that chunk are written).
template <class Vectors>
static inline void write_query_codes(Vectors&& vector, float largest, float* row, int64_t head_dim) {
  const float to_code = largest > 0.0f ? 127.0f / largest : 0.0f;
  const __m512 factor = _mm512_set1_ps(to_code);
  __m512i sums = _mm512_setzero_si512();
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(vector(d), factor));
    sums = _mm512_add_epi32(sums, codes);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(reinterpret_cast<int8_t*>(row) + d), _mm512_cvtsepi32_epi8(codes));
  }
  const int32_t bias = 128 * _mm512_reduce_add_epi32(sums);
  row[head_dim / 4] = largest / 127.0f;
  __builtin_memcpy(row + head_dim / 4 + 1, &bias, sizeof bias);
}

// A query row quantized in place of its floats: its head_dim codes (value / scale rounded to nearest even, within
// +-127), then, at float head_dim / 4, the scale (the row's largest magnitude / 127), and at head_dim / 4 + 1 the
// int32 128 * the codes' sum (what biased key codes add to a dot product, score_rows_int8). head_dim is a multiple
// of 16 (a chunk of 16 floats is read before its 16 codes overwrite 4 of the floats already read).
static inline void quantize_query_row(float* row, int64_t head_dim) {
  write_query_codes([row](int64_t d) { return _mm512_loadu_ps(row + d); }, ScaledRow::largest(row, head_dim), row,
                    head_dim);
}

// A row's query (src, head_dim floats) scaled by `scale` and quantized into row as quantize_query_row quantizes
// it, for a head_dim of at most 128 (a multiple of 16): kept in registers while its largest magnitude is found and
// its codes made, instead of stored and read back twice. The same codes, scale and bias, bit for bit.
static inline void quantize_scaled_query(const float* src, float scale, float* row, int64_t head_dim) {
  const __m512 by = _mm512_set1_ps(scale), zero = _mm512_setzero_ps();
  __m512 v[8];
  __m512 most = zero;
  for (int64_t k = 0; k < head_dim / 16; ++k) {
    v[k] = _mm512_mul_ps(_mm512_loadu_ps(src + 16 * k), by);
    most = _mm512_max_ps(most, _mm512_max_ps(v[k], _mm512_sub_ps(zero, v[k])));
  }
  write_query_codes([&v](int64_t d) { return v[d / 16]; }, _mm512_reduce_max_ps(most), row, head_dim);
}

// What quantize_query_row left after a row's codes: its scale and 128 * the codes' sum.
struct QueryRowCodes {
  float scale;
  int32_t bias;
};
static inline QueryRowCodes query_row_codes(const float* row, int64_t head_dim) {
  QueryRowCodes codes{row[head_dim / 4], 0};
  __builtin_memcpy(&codes.bias, row + head_dim / 4 + 1, sizeof codes.bias);
  return codes;
}

static inline __m256i halves_added_epi32(__m512i x) {
  return _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1));
}

// The int32 sums of a's, b's, c's and d's lanes.
static inline __m128i hsum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
  const auto halves = halves_added_epi32;
  const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(halves(a), halves(b)), _mm256_hadd_epi32(halves(c), halves(d)));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

// score_rows for an int8 cache, the query rows quantized by quantize_query_row (`q`: head_dim floats apart). A key's
// codes are biased to unsigned (+128, a sign flip) for vpdpbusd's unsigned operand, and each row's 128 * codes' sum
// is taken back; the exact int32 dot product is then scaled by the row's and the key's scales. A head_dim that is no
// multiple of 64 reads its last codes masked (a masked key lane becomes 128 against a zero query code).
template <int ROWS, class Ahead>
static inline void score_rows_int8(const float* q, int64_t head_dim, const Int8* const* keys, int64_t num_keys,
                                   float* scores, Ahead& ahead) {
  const int64_t full = head_dim - head_dim % 64;
  const __mmask64 tail = head_dim % 64 ? ~0ull >> (64 - head_dim % 64) : 0;
  const __m512i flip = _mm512_set1_epi8(-128);
  __m128 row_scale[ROWS];
  __m128i row_bias[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    const QueryRowCodes row = query_row_codes(q + r * head_dim, head_dim);
    row_scale[r] = _mm_set1_ps(row.scale), row_bias[r] = _mm_set1_epi32(row.bias);
  }
  for (int64_t j = 0; j < num_keys; j += 4) {
    ahead();
    __m512i acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
    for (int64_t d = 0; d < head_dim; d += 64) {
      const __mmask64 lanes = d < full ? ~0ull : tail;
      __m512i k[4];
      for (int c = 0; c < 4; ++c) k[c] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(lanes, keys[j + c] + d), flip);
      for (int r = 0; r < ROWS; ++r) {
        const __m512i qv = _mm512_maskz_loadu_epi8(lanes, reinterpret_cast<const int8_t*>(q + r * head_dim) + d);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], k[c], qv);
      }
    }
    __m128 key_scale = _mm_setr_ps(KvElement<Int8>::scale(keys[j], head_dim), KvElement<Int8>::scale(keys[j + 1], head_dim),
                                   KvElement<Int8>::scale(keys[j + 2], head_dim),
                                   KvElement<Int8>::scale(keys[j + 3], head_dim));
    for (int r = 0; r < ROWS; ++r) {
      const __m128i dots = _mm_sub_epi32(hsum4_epi32(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), row_bias[r]);
      _mm_storeu_ps(scores + r * kKeySpan + j, _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(dots), row_scale[r]), key_scale));
    }
  }
}

// A prompt's scores (many rows per span) without a horizontal sum per key and row: the span's keys are regrouped
// once (int8_key_groups), four keys' 64-byte chunks into four vectors, vector m holding in each 128-bit lane L the
// four keys' 4-byte groups 4L + m; each row's codes are repeated to match (query_groups), vpdpbusd then leaves in
// each lane four keys' sums over that lane's groups, and 16 keys' accumulators are added across lanes by 6 shuffles
// (lanes_added). The int32 sums and the scores are score_rows_int8's, bit for bit.
constexpr int64_t kMaxGroupedDim = 256;

// groups[((j / 4) * chunks + c) * 4 + m] for keys j..j + 3 of `keys` (num_keys a multiple of 16), chunk c of
// their codes biased to unsigned as score_rows_int8 does; the tail of a head_dim no multiple of 64 reads 128.
static inline void int8_key_groups(const Int8* const* keys, int64_t num_keys, int64_t head_dim, __m512i* groups) {
  const int64_t chunks = (head_dim + 63) / 64;
  const __m512i flip = _mm512_set1_epi8(-128);
  for (int64_t j = 0; j < num_keys; j += 4) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t left = head_dim - c * 64;
      const __mmask64 lanes = left >= 64 ? ~0ull : ~0ull >> (64 - left);
      __m512i k[4];
      for (int i = 0; i < 4; ++i) k[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(lanes, keys[j + i] + c * 64), flip);
      const __m512i t0 = _mm512_unpacklo_epi32(k[0], k[1]), t1 = _mm512_unpackhi_epi32(k[0], k[1]);
      const __m512i t2 = _mm512_unpacklo_epi32(k[2], k[3]), t3 = _mm512_unpackhi_epi32(k[2], k[3]);
      __m512i* out = groups + ((j / 4) * chunks + c) * 4;
      _mm512_storeu_si512(out + 0, _mm512_unpacklo_epi64(t0, t2));
      _mm512_storeu_si512(out + 1, _mm512_unpackhi_epi64(t0, t2));
      _mm512_storeu_si512(out + 2, _mm512_unpacklo_epi64(t1, t3));
      _mm512_storeu_si512(out + 3, _mm512_unpackhi_epi64(t1, t3));
    }
  }
}

// The partners of int8_key_groups' vectors for ROWS query rows (quantize_query_row's codes, dim floats apart):
// out[(r * chunks + c) * 4 + m] holds in lane L row r's group 4L + m of chunk c, four times (zero past head_dim).
template <int ROWS>
static inline void query_groups(const float* q, int64_t head_dim, __m512i* out) {
  const int64_t chunks = (head_dim + 63) / 64;
  for (int r = 0; r < ROWS; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t left = head_dim - c * 64;
      const __mmask64 lanes = left >= 64 ? ~0ull : ~0ull >> (64 - left);
      const __m512i codes = _mm512_maskz_loadu_epi8(lanes, reinterpret_cast<const int8_t*>(q + r * head_dim) + c * 64);
      __m512i* row = out + (r * chunks + c) * 4;
      row[0] = _mm512_shuffle_epi32(codes, _MM_PERM_AAAA), row[1] = _mm512_shuffle_epi32(codes, _MM_PERM_BBBB);
      row[2] = _mm512_shuffle_epi32(codes, _MM_PERM_CCCC), row[3] = _mm512_shuffle_epi32(codes, _MM_PERM_DDDD);
    }
  }
}

// Lane g of the result: the sum of a[g]'s four lanes.
static inline __m512i lanes_added(const __m512i* a) {
  const __m512i x01 = _mm512_add_epi32(_mm512_shuffle_i32x4(a[0], a[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_i32x4(a[0], a[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i x23 = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2], a[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_i32x4(a[2], a[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// score_rows_int8 of ROWS rows over num_keys keys (a multiple of 16) regrouped by int8_key_groups; `scales`: the
// keys' scales. ahead() is called once per 4 keys, as there.
template <int ROWS, class Ahead>
static inline void score_rows_int8_grouped(const float* q, int64_t head_dim, const __m512i* groups,
                                           const float* scales, int64_t num_keys, float* scores, Ahead& ahead) {
  const int64_t chunks = (head_dim + 63) / 64;
  __m512i partners[ROWS * (kMaxGroupedDim / 64) * 4];
  query_groups<ROWS>(q, head_dim, partners);
  QueryRowCodes rows[ROWS];
  for (int r = 0; r < ROWS; ++r) rows[r] = query_row_codes(q + r * head_dim, head_dim);
  for (int64_t j = 0; j < num_keys; j += 16) {
    for (int g = 0; g < 4; ++g) ahead();
    __m512i acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks; ++c) {
      for (int m = 0; m < 4; ++m) {
        for (int g = 0; g < 4; ++g) {
          const __m512i keys = _mm512_loadu_si512(groups + ((j / 4 + g) * chunks + c) * 4 + m);
          for (int r = 0; r < ROWS; ++r) acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], keys, partners[(r * chunks + c) * 4 + m]);
        }
      }
    }
    const __m512 key_scale = _mm512_loadu_ps(scales + j);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i dots = _mm512_sub_epi32(lanes_added(acc[r]), _mm512_set1_epi32(rows[r].bias));
      _mm512_storeu_ps(scores + r * kKeySpan + j,
                       _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(rows[r].scale)), key_scale));
    }
  }
}

// Four keys' 64-byte chunks of value codes interleaved byte by byte: dword k of lane L of v[n] holds the four keys'
// codes of dim 16L + 4n + k (so that a dword of four keys' weights multiplies them in vpdpbusd).
static inline void value_groups(__m512i a, __m512i b, __m512i c, __m512i d, __m512i* v) {
  const __m512i t0 = _mm512_unpacklo_epi8(a, b), t1 = _mm512_unpackhi_epi8(a, b);
  const __m512i t2 = _mm512_unpacklo_epi8(c, d), t3 = _mm512_unpackhi_epi8(c, d);
  v[0] = _mm512_unpacklo_epi16(t0, t2), v[1] = _mm512_unpackhi_epi16(t0, t2);
  v[2] = _mm512_unpacklo_epi16(t1, t3), v[3] = _mm512_unpackhi_epi16(t1, t3);
}

// The 4 x 4 transpose of s's 128-bit lanes: out[L] holds lane L of s[0], s[1], s[2], s[3] (value_groups' sums
// back in the order of the dims).
static inline void lanes_transposed(const __m512i* s, __m512i* out) {
  const __m512i x0 = _mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i x1 = _mm512_shuffle_i32x4(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i x2 = _mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i x3 = _mm512_shuffle_i32x4(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2));
  out[0] = _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)), out[1] = _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));
  out[2] = _mm512_shuffle_i32x4(x2, x3, _MM_SHUFFLE(2, 0, 2, 0)), out[3] = _mm512_shuffle_i32x4(x2, x3, _MM_SHUFFLE(3, 1, 3, 1));
}

// ROWS rows' probabilities (kKeySpan apart) of num_keys keys as unsigned 8-bit weights, each row's largest 255
// (rounded to nearest even; zero from num_keys to the next multiple of 4), and unit[r], the weight of code 1.
template <int ROWS>
static inline void int8_value_weights(const float* probs, int64_t num_keys, uint8_t (*weights)[kKeySpan], float* unit) {
  const int64_t groups = (num_keys + 3) / 4;
  for (int r = 0; r < ROWS; ++r) {
    const float* row = probs + r * kKeySpan;
    __m512 most = _mm512_setzero_ps();
    for (int64_t j = 0; j < num_keys; j += 16) {
      const __mmask16 lanes = num_keys - j >= 16 ? 0xffff : (1u << (num_keys - j)) - 1;
      most = _mm512_max_ps(most, _mm512_maskz_loadu_ps(lanes, row + j));
    }
    const float largest = _mm512_reduce_max_ps(most);
    const __m512 to_code = _mm512_set1_ps(largest > 0.0f ? 255.0f / largest : 0.0f);
    unit[r] = largest / 255.0f;
    for (int64_t j = 0; j < groups * 4; j += 16) {
      const __mmask16 lanes = num_keys - j >= 16 ? 0xffff : (1u << (num_keys - j)) - 1;
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row + j), to_code));
      _mm_store_si128(reinterpret_cast<__m128i*>(weights[r] + j), _mm512_cvtusepi32_epi8(codes));
    }
  }
}

// accumulate_values for an int8 cache, 8-bit weights times 8-bit values as FlashAttention-3 and SageAttention2
// multiply probabilities and values on GPUs: each row's weights of the span (its probabilities, value scales folded
// in) become unsigned 8-bit codes, the row's largest 255 (rounded to nearest even), and vpdpbusd adds four keys'
// code products at once in int32 (value_groups), scaled back once per span. A weight's error is at most 1/510 of
// the row's largest in the span (tests/support/numerics.py: int8_weights_error_bound). ahead() is called once per
// 4 keys and 64 dims.
template <int ROWS, class Ahead>
static inline void accumulate_values_int8(float* acc, const float* probs, const Int8* const* values,
                                          int64_t num_keys, int64_t head_dim, Ahead& ahead) {
  const int64_t groups = (num_keys + 3) / 4;
  alignas(64) uint8_t weights[ROWS][kKeySpan];
  float unit[ROWS];  // the weight of code 1
  int8_value_weights<ROWS>(probs, num_keys, weights, unit);
  for (int64_t c = 0; c * 64 < head_dim; ++c) {
    const int64_t left = head_dim - c * 64;
    const __mmask64 lanes = left >= 64 ? ~0ull : ~0ull >> (64 - left);
    __m512i sums[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int n = 0; n < 4; ++n) sums[r][n] = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; ++g) {
      ahead();
      __m512i k[4], v[4];
      for (int i = 0; i < 4; ++i) {
        const Int8* row = 4 * g + i < num_keys ? values[4 * g + i] : values[0];  // its weight is 0
        k[i] = _mm512_maskz_loadu_epi8(lanes, row + c * 64);
      }
      value_groups(k[0], k[1], k[2], k[3], v);
      for (int r = 0; r < ROWS; ++r) {
        uint32_t word;
        __builtin_memcpy(&word, weights[r] + 4 * g, sizeof word);
        const __m512i w = _mm512_set1_epi32(static_cast<int32_t>(word));
        for (int n = 0; n < 4; ++n) sums[r][n] = _mm512_dpbusd_epi32(sums[r][n], w, v[n]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      __m512i in_order[4];
      lanes_transposed(sums[r], in_order);
      const __m512 u = _mm512_set1_ps(unit[r]);
      float* out = acc + r * head_dim + c * 64;
      for (int L = 0; L < 4 && 16 * L < left; ++L) {
        _mm512_storeu_ps(out + 16 * L, _mm512_fmadd_ps(_mm512_cvtepi32_ps(in_order[L]), u, _mm512_loadu_ps(out + 16 * L)));
      }
    }
  }
}
#else
template <class Cache>
constexpr bool kInt8Dot = false;
static inline void quantize_query_row(float* row, int64_t head_dim);
template <int ROWS, class Ahead>
static inline void score_rows_int8(const float* q, int64_t head_dim, const Int8* const* keys, int64_t num_keys,
                                   float* scores, Ahead& ahead);
template <int ROWS, class Ahead>
static inline void accumulate_values_int8(float* acc, const float* probs, const Int8* const* values,
                                          int64_t num_keys, int64_t head_dim, Ahead& ahead);
constexpr int64_t kMaxGroupedDim = 0;
static inline void int8_key_groups(const Int8* const* keys, int64_t num_keys, int64_t head_dim, __m512i* groups);
template <int ROWS, class Ahead>
static inline void score_rows_int8_grouped(const float* q, int64_t head_dim, const __m512i* groups,
                                           const float* scales, int64_t num_keys, float* scores, Ahead& ahead);
#endif
