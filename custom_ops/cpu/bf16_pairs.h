// x rounded to bf16 pairs, the operand layout of vdpbf16ps, and vdpbf16ps with one pair broadcast: included
// inside an AVX512-BF16 region (the bf16 GEMM's in linear_gemm.cc, the attention's in kernels_avx512_bf16.cc); no
// include guard, nothing from the standard library.

// words[i] = bf16(x[2i]) | bf16(x[2i + 1]) << 16 (nearest even) for x[0..n), the pair past n zero-padded.
static inline void to_bf16_pairs(const float* x, int64_t n, uint32_t* words) {
  for (int64_t i = 0; i < n; i += 32) {
    const int64_t rest = n - i;
    const __mmask16 low = rest >= 16 ? 0xffff : static_cast<__mmask16>((1u << rest) - 1);
    const __mmask16 high = rest >= 32 ? 0xffff : rest <= 16 ? 0 : static_cast<__mmask16>((1u << (rest - 16)) - 1);
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, x + i + 16), _mm512_maskz_loadu_ps(low, x + i));
    const int64_t num_words = rest >= 32 ? 16 : (rest + 1) / 2;
    _mm512_mask_storeu_epi32(words + i / 2, static_cast<__mmask16>((1u << num_words) - 1), reinterpret_cast<__m512i>(pairs));
  }
}

// acc += the products of `pairs`' bf16 pairs and the pair at `word`, broadcast by the instruction itself
// ({1to16}). For _mm512_set1_epi32 GCC emits a separate vpbroadcastd per row and word (it folds broadcasts
// into vfmadd231ps, not into vdpbf16ps). Without them, on AMD EPYC Zen 4, the 4 GEMMs of the default model
// took 0.88-0.92x the time (512 and 64 rows, 3 runs alternated): 12 rows x 2 panels at ~215 of a core's ~233
// bf16 GFLOP/s, up from ~190. Every loop over the accumulators it updates must be unrolled whole: one run-time
// index into them keeps them in memory, and GCC then stores them all after each dot_broadcast.
static inline __attribute__((always_inline)) __m512 dot_broadcast(__m512 acc, __m512bh pairs, const uint32_t* word) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(pairs), "m"(*word));
  return acc;
}
