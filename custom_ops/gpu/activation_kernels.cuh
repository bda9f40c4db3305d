// SiLU-and-multiply on the fused gate|up projection: out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i].
#pragma once

#include "numeric.cuh"

namespace bs::gpu {

constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxElementwiseBlocks = 1 << 16;  // a grid-stride loop covers the rest

template <class T>
struct SiluAndMulParams {
  const T* gate_up;  // [rows, 2 * width]
  T* out;            // [rows, width]
  int64_t rows, width;
};

template <class T>
__global__ void __launch_bounds__(kElementwiseThreads) silu_and_mul_kernel(const SiluAndMulParams<T> p) {
  const int64_t count = p.rows * p.width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < count; index += stride) {
    const int64_t row = index / p.width, column = index % p.width;
    const float gate = to_float(p.gate_up[row * 2 * p.width + column]);
    const float up = to_float(p.gate_up[row * 2 * p.width + p.width + column]);
    p.out[index] = from_float<T>(gate / (1.0f + expf(-gate)) * up);
  }
}

template <class T>
Status launch_silu_and_mul(const SiluAndMulParams<T>& p, Stream stream) {
  if (p.rows < 0 || p.width < 0) return kInvalidArgument;
  const int64_t count = p.rows * p.width;
  if (count == 0) return kSuccess;
  const int64_t blocks = std::min<int64_t>((count + kElementwiseThreads - 1) / kElementwiseThreads, kMaxElementwiseBlocks);
  BS_LAUNCH(silu_and_mul_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(kElementwiseThreads), 0, stream, p);
  return launch_status();
}

}  // namespace bs::gpu
