#include "linear_gemm.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace bs::linear {
namespace {

// Bytes of x rows a block holds: with the current weight panel (up to 96 KiB at depth 1536) it stays
// in a 512 KiB L2.
constexpr int64_t kBlockBytes = 256 << 10;

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
typedef float Vec __attribute__((vector_size(32)));
constexpr int kMaxRows = 6;  // 12 accumulators + 2 weight registers of the 16 ymm
#include "linear_tile.h"
#pragma GCC pop_options
}  // namespace avx2

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
typedef float Vec __attribute__((vector_size(64)));
constexpr int kMaxRows = 12;  // 12 accumulators of the 32 zmm: one weight load feeds 12 FMAs
#include "linear_tile.h"
#pragma GCC pop_options
}  // namespace avx512

}  // namespace

void pack_weight(const float* w, int64_t k, int64_t n, float* packed) {
  const int64_t panels = num_panels(n);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t cols = std::min<int64_t>(kPanelWidth, n - p * kPanelWidth);
    for (int64_t row = 0; row < k; ++row) {
      float* out = packed + (p * k + row) * kPanelWidth;
      std::memcpy(out, w + row * n + p * kPanelWidth, cols * sizeof(float));
      std::fill(out + cols, out + kPanelWidth, 0.0f);
    }
  }
}

void gemm(bool avx512, const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
          float* y) {
  if (avx512) {
    avx512::gemm(x, m, k, packed, n, bias, y);
  } else {
    avx2::gemm(x, m, k, packed, n, bias, y);
  }
}

}  // namespace bs::linear
