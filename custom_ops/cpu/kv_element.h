// How the kernels read and write each KV element type (kv_types.h): one row per type, for both vector widths.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace, after `Vec`,
// `reg` and `W`; no include guard, only builtins and own code.
//   load(p)        W elements from p, widened to fp32 (exactly)
//   store(p, v)    W values of v as elements
//   from_float(x)  one value as an element
//   kBf16Pairs     the elements are bf16: two of them make a vdpbf16ps operand as stored (attention_bf16_dot.h)
//   kScaled        a row's values are codes times the row's scale (kv_types.h): load(p) gives the codes' values,
//                  scale(row, dim) the factor, and a row is written whole by store_scaled_row; false: scale is 1
template <class T>
struct KvElement;

template <>
struct KvElement<float> {
  static constexpr bool kBf16Pairs = false;
  static constexpr bool kScaled = false;
  static inline reg load(const float* p) { return Vec::load(p); }
  static inline void store(float* p, reg v) { Vec::store(p, v); }
  static inline float from_float(float x) { return x; }
};

// Rounded to nearest even; the values are finite. A body per vector width (the region's `reg` picks one; the other
// is never compiled for it).
template <>
struct KvElement<Bf16> {
  static constexpr bool kBf16Pairs = true;
  static constexpr bool kScaled = false;
  static inline reg load(const Bf16* p) { return widened(p, reg{}); }
  static inline void store(Bf16* p, reg v) { rounded(p, v); }
  static inline Bf16 from_float(float x) {
    unsigned bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    return {static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16)};
  }

  static inline __m256 widened(const Bf16* p, __m256) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static inline __m512 widened(const Bf16* p, __m512) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static inline void rounded(Bf16* p, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static inline void rounded(Bf16* p, __m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
};

// The scaled rows' common part: the scale after a row's head_dim codes, as a bf16 rounded up (kv_types.h).
struct ScaledRow {
  static inline float bf16_value(uint16_t bits) {
    const unsigned wide = static_cast<unsigned>(bits) << 16;
    float x;
    __builtin_memcpy(&x, &wide, sizeof x);
    return x;
  }
  // The least bf16 >= x (x finite and >= 0).
  static inline uint16_t bf16_at_least(float x) {
    unsigned bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    return static_cast<uint16_t>((bits + 0xffffu) >> 16);
  }
  static inline float stored_scale(const void* row, int64_t dim) {
    uint16_t bits;
    __builtin_memcpy(&bits, static_cast<const char*>(row) + dim, sizeof bits);
    return bf16_value(bits);
  }
  // The row's largest magnitude.
  static inline float largest(const float* x, int64_t dim) {
    const int64_t full = dim - dim % W;
    reg most = Vec::zero();
    for (int64_t i = 0; i < full; i += W) {
      const reg v = Vec::load(x + i);
      most = Vec::max(most, Vec::max(v, Vec::sub(Vec::zero(), v)));
    }
    float largest = Vec::reduce_max(most);
    for (int64_t i = full; i < dim; ++i) largest = __builtin_fmaxf(largest, __builtin_fabsf(x[i]));
    return largest;
  }
  // Writes the scale of a row whose largest magnitude is `largest` for codes up to `top`, and returns the factor
  // that takes a value to its code (0 for a zero row).
  static inline float write_scale(void* row, int64_t dim, float largest, float top) {
    const uint16_t bits = bf16_at_least(largest / top);
    __builtin_memcpy(static_cast<char*>(row) + dim, &bits, sizeof bits);
    const float scale = bf16_value(bits);
    return scale > 0.0f ? 1.0f / scale : 0.0f;
  }
};

// int8 codes, value = code * scale.
template <>
struct KvElement<Int8> {
  static constexpr bool kBf16Pairs = false;
  static constexpr bool kScaled = true;
  static inline reg load(const Int8* p) { return widened(p, reg{}); }
  static inline float scale(const Int8* row, int64_t dim) { return ScaledRow::stored_scale(row, dim); }
  static inline void store_scaled_row(const float* x, Int8* out, int64_t dim) {
    const float to_code = ScaledRow::write_scale(out, dim, ScaledRow::largest(x, dim), 127.0f);
    const int64_t full = dim - dim % W;
    const reg factor = Vec::set1(to_code), top = Vec::set1(127.0f), bottom = Vec::set1(-127.0f);
    for (int64_t i = 0; i < full; i += W) {
      codes(out + i, Vec::max(bottom, Vec::min(top, Vec::mul(Vec::load(x + i), factor))));
    }
    for (int64_t i = full; i < dim; ++i) {
      const float code = __builtin_fmaxf(-127.0f, __builtin_fminf(127.0f, x[i] * to_code));
      out[i].bits = static_cast<int8_t>(__builtin_nearbyintf(code));
    }
  }

  static inline __m256 widened(const Int8* p, __m256) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static inline __m512 widened(const Int8* p, __m512) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // v's lanes (within +-127) rounded to nearest even, as codes.
  static inline void codes(Int8* p, __m256 v) {
    const __m256i whole = _mm256_cvtps_epi32(v);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(whole), _mm256_extracti128_si256(whole, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
  }
  static inline void codes(Int8* p, __m512 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
};

// fp8 e4m3 codes. A code's 7 magnitude bits placed at bits 20..26 of an fp32 make 2^-120 times its value (normal
// and subnormal codes alike), its sign at bit 31: load gives that, and scale() carries the 2^120.
template <>
struct KvElement<Fp8E4M3> {
  static constexpr bool kBf16Pairs = false;
  static constexpr bool kScaled = true;
  static inline reg load(const Fp8E4M3* p) { return widened(p, reg{}); }
  static inline float scale(const Fp8E4M3* row, int64_t dim) { return ScaledRow::stored_scale(row, dim) * 0x1p120f; }
  static inline void store_scaled_row(const float* x, Fp8E4M3* out, int64_t dim) {
    const float to_code = ScaledRow::write_scale(out, dim, ScaledRow::largest(x, dim), 448.0f) * 0x1p-120f;
    const int64_t full = dim - dim % W;
    const reg factor = Vec::set1(to_code);
    for (int64_t i = 0; i < full; i += W) codes(out + i, Vec::mul(Vec::load(x + i), factor));
    for (int64_t i = full; i < dim; ++i) out[i].bits = code(x[i] * to_code);
  }

  // The code of 2^-120 times a value within +-448 (bits 20..26 rounded to nearest even, the largest code kept).
  static inline uint8_t code(float scaled) {
    unsigned bits;
    __builtin_memcpy(&bits, &scaled, sizeof bits);
    const unsigned magnitude = bits & 0x7fffffffu;
    unsigned rounded = (magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20;
    rounded = rounded > 0x7eu ? 0x7eu : rounded;
    return static_cast<uint8_t>(rounded | ((bits >> 24) & 0x80u));
  }
  // Each code sign-extended to 32 bits and shifted left by 20: its magnitude lands at bits 20..26, its sign at 27..31
  // (bits 7..11 of the extended code are copies of it); keeping bits 20..26 and 31 leaves the sign at bit 31 alone.
  // Three instructions a vector (a zero-extension, two masks, two shifts and an or took six).
  static constexpr int kWidenedBits = static_cast<int>(0x87f00000u);
  static inline __m256 widened(const Fp8E4M3* p, __m256) {
    const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(kWidenedBits)));
  }
  static inline __m512 widened(const Fp8E4M3* p, __m512) {
    const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(kWidenedBits)));
  }
  static inline __m256i rounded_codes(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, 20), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_min_epu32(
        _mm256_srli_epi32(_mm256_add_epi32(magnitude, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7ffff))), 20),
        _mm256_set1_epi32(0x7e));
    return _mm256_or_si256(rounded, _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80)));
  }
  static inline void codes(Fp8E4M3* p, __m256 v) {
    const __m256i c = rounded_codes(v);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
  }
  static inline void codes(Fp8E4M3* p, __m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, 20), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_min_epu32(
        _mm512_srli_epi32(_mm512_add_epi32(magnitude, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7ffff))), 20),
        _mm512_set1_epi32(0x7e));
    const __m512i c = _mm512_or_si512(rounded, _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(c));
  }
};
