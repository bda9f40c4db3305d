// RMSNorm with the residual add fused in: summed = x + residual (stored, the next layer's
// residual), out = summed * rsqrt(mean(summed^2) + eps) * weight. One block per row.
#pragma once

#include "numeric.cuh"

namespace bs::gpu {

constexpr int kNormThreads = 256;

template <class T>
struct AddRmsNormParams {
  const T* x;         // [rows, width]
  const T* residual;  // [rows, width], or null: plain RMSNorm of x
  const T* weight;    // [width]
  T* out;             // [rows, width]
  T* summed;          // [rows, width] x + residual as stored; null when residual is
  int64_t rows, width;
  float eps;
};

// The row's input as the next layer sees it: x + residual rounded to T, so that out normalizes
// exactly the stored residual (for float32 the rounding is a no-op).
template <class T>
BS_DEVICE float summed_input(const AddRmsNormParams<T>& p, int64_t index) {
  const float x = to_float(p.x[index]);
  return p.residual == nullptr ? x : to_float(from_float<T>(x + to_float(p.residual[index])));
}

template <class T>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(const AddRmsNormParams<T> p) {
  BS_DYNAMIC_SHARED(shared);
  float* warp_totals = reinterpret_cast<float*>(shared);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * p.width;
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < p.width; i += blockDim.x) {
    const float value = summed_input(p, first + i);
    if (p.summed != nullptr) p.summed[first + i] = from_float<T>(value);
    squares += value * value;
  }
  const float inv_rms = 1.0f / sqrtf(block_sum(squares, warp_totals) / static_cast<float>(p.width) + p.eps);
  for (int64_t i = threadIdx.x; i < p.width; i += blockDim.x) {
    p.out[first + i] = from_float<T>(summed_input(p, first + i) * inv_rms * to_float(p.weight[i]));
  }
}

template <class T>
Status launch_add_rms_norm(const AddRmsNormParams<T>& p, Stream stream) {
  if (p.rows <= 0 || p.width <= 0) return p.rows < 0 || p.width < 0 ? kInvalidArgument : kSuccess;
  if ((p.residual == nullptr) != (p.summed == nullptr)) return kInvalidArgument;
  const size_t shared_bytes = kNormThreads / kWarpSize * sizeof(float);
  BS_LAUNCH(add_rms_norm_kernel<T>, dim3(static_cast<unsigned>(p.rows)), dim3(kNormThreads), shared_bytes, stream, p);
  return launch_status();
}

}  // namespace bs::gpu
