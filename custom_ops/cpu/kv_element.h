// How the kernels read and write each KV element type (kv_types.h): one row per type, for both vector widths.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace, after `Vec`,
// `reg` and `W`; no include guard, only builtins and own code.
//   load(p)        W elements from p, widened to fp32 (exactly)
//   store(p, v)    W values of v as elements
//   from_float(x)  one value as an element
//   kBf16Pairs     the elements are bf16: two of them make a vdpbf16ps operand as stored (attention_bf16_dot.h)
template <class T>
struct KvElement;

template <>
struct KvElement<float> {
  static constexpr bool kBf16Pairs = false;
  static inline reg load(const float* p) { return Vec::load(p); }
  static inline void store(float* p, reg v) { Vec::store(p, v); }
  static inline float from_float(float x) { return x; }
};

// Rounded to nearest even; the values are finite. A body per vector width (the region's `reg` picks one; the other
// is never compiled for it).
template <>
struct KvElement<Bf16> {
  static constexpr bool kBf16Pairs = true;
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
