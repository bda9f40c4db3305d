// 16-lane fp32 vectors for kernel_impl.h; include only inside a `#pragma GCC target("avx512f,...")` region, once per
// region (no include guard: linear_gemm.cc has several).

struct Vec {
  using reg = __m512;
  static constexpr int W = 16;
  static inline reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static inline reg set1(float x) { return _mm512_set1_ps(x); }
  static inline reg zero() { return _mm512_setzero_ps(); }
  static inline reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static inline reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static inline reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static inline reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static inline reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static inline reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
  static inline reg floor(reg a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // v where v >= at_least, else 0 (a NaN lane: 0)
  static inline reg keep_at_least(reg v, reg at_least) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, at_least, _CMP_GE_OQ), v); }
  // v's first n lanes (0 <= n <= W), the others those of `fill`
  static inline reg first_lanes(reg v, int n, reg fill) {
    return _mm512_mask_mov_ps(fill, static_cast<__mmask16>((1u << n) - 1), v);
  }
  static inline reg pow2(reg n) {
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(bits);
  }
  // The first lane equal to x, or -1.
  static inline int first_equal(reg v, float x) {
    const unsigned mask = _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_EQ_OQ);
    return mask ? __builtin_ctz(mask) : -1;
  }
  static inline float reduce_max(reg v) { return _mm512_reduce_max_ps(v); }
  static inline float reduce_add(reg v) { return _mm512_reduce_add_ps(v); }
  static inline __m256 halves_added(reg v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  static inline void hsum4_store(reg a, reg b, reg c, reg d, float* out) {
    __m256 ab = _mm256_hadd_ps(halves_added(a), halves_added(b));
    __m256 abcd = _mm256_hadd_ps(ab, _mm256_hadd_ps(halves_added(c), halves_added(d)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
};
