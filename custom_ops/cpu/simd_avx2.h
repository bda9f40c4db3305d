// 8-lane fp32 vectors for kernel_impl.h; include only inside a `#pragma GCC target("avx2,fma")` region.
#pragma once

struct Vec {
  using reg = __m256;
  static constexpr int W = 8;
  static inline reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static inline reg set1(float x) { return _mm256_set1_ps(x); }
  static inline reg zero() { return _mm256_setzero_ps(); }
  static inline reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static inline reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static inline reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static inline reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static inline reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static inline reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
  static inline reg floor(reg a) { return _mm256_floor_ps(a); }
  // v where v >= at_least, else 0 (a NaN lane: 0)
  static inline reg keep_at_least(reg v, reg at_least) { return _mm256_and_ps(v, _mm256_cmp_ps(v, at_least, _CMP_GE_OQ)); }
  // v's first n lanes (0 <= n <= W), the others those of `fill`
  static inline reg first_lanes(reg v, int n, reg fill) {
    const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(fill, v, _mm256_castsi256_ps(below));
  }
  // 2^n for integral n in [-127, 127] held in a float vector
  static inline reg pow2(reg n) {
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(bits);
  }
  // The first lane equal to x, or -1.
  static inline int first_equal(reg v, float x) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(x), _CMP_EQ_OQ));
    return mask ? __builtin_ctz(mask) : -1;
  }
  static inline float reduce_max(reg v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static inline float reduce_add(reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // out[0..3] = the sums of a, b, c, d
  static inline void hsum4_store(reg a, reg b, reg c, reg d, float* out) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
};
