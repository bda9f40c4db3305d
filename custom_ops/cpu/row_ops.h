// The row-wise kernels over a batch of rows, on one thread below kParallelFloats of work. Used by the
// single ops (elementwise_ops.cc) and the fused decoder stack (decoder_stack_op.cc).
#pragma once

#include <cstdint>

#include "kernel_set.h"

namespace bs {

// out = rms_norm(x + residual) * weight per row (residual may be null); x + residual goes to `summed`
// unless it is null.
inline void rms_norm_rows(const KernelSet& kernels, const float* x, const float* residual, const float* weight,
                          float* out, float* summed, int64_t rows, int64_t width, float eps) {
#pragma omp parallel for schedule(static) if (rows * width >= kParallelFloats)
  for (int64_t r = 0; r < rows; ++r) {
    kernels.rms_norm_row(x + r * width, residual == nullptr ? nullptr : residual + r * width, weight, out + r * width,
                         summed == nullptr ? nullptr : summed + r * width, width, eps);
  }
}

// out[r] = silu(gate_up[r, :width]) * gate_up[r, width:]
inline void silu_and_mul_rows(const KernelSet& kernels, const float* gate_up, float* out, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static) if (rows * width >= kParallelFloats)
  for (int64_t r = 0; r < rows; ++r) kernels.silu_and_mul_row(gate_up + r * 2 * width, out + r * width, width);
}

}  // namespace bs
