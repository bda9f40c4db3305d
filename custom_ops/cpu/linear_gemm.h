// fp32 GEMM over weights packed once into 16-column panels: y = x @ W (+ bias).
#pragma once

#include <cstdint>

namespace bs::linear {

constexpr int kPanelWidth = 16;  // output columns per packed weight panel

inline int64_t num_panels(int64_t n) { return (n + kPanelWidth - 1) / kPanelWidth; }

// w[k, n] (row-major) -> packed[num_panels(n), k, kPanelWidth], the columns past n zero.
void pack_weight(const float* w, int64_t k, int64_t n, float* packed);

// y[m, n] = x[m, k] @ W + bias (bias may be null); `avx512` picks that kernel (the caller checked the CPU).
void gemm(bool avx512, const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
          float* y);

}  // namespace bs::linear
