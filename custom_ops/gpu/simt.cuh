// The few CUDA constructs blockserve's kernels use: from CUDA itself under nvcc, or from a CPU
// emulation (simt_emulation.h) under a plain C++ compiler, so the CPU tests run the very same
// kernel source that the GPU runs. Kernels keep to what both provide:
//   - one-dimensional blocks whose size is a multiple of 32, dynamic shared memory only;
//   - __syncthreads() and the warp reductions below reached by every thread of the block
//     (block-uniform control flow), and a block that returns early returns as a whole;
//   - kernels with a single template parameter, launched through BS_LAUNCH;
//   - of CUDA's float intrinsics, the correctly rounded __fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn and
//     __float2int_rn (where a result must be bit-exact: never fused), __uint_as_float, __float_as_uint.
#pragma once

#include <cstdint>

#ifdef __CUDACC__

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define BS_HOST_DEVICE __host__ __device__
#define BS_DEVICE __device__ __forceinline__
#define BS_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)
#define BS_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]

namespace bs::gpu {

using Status = cudaError_t;
using Stream = cudaStream_t;
constexpr Status kSuccess = cudaSuccess;
constexpr Status kInvalidArgument = cudaErrorInvalidValue;

inline const char* status_text(Status status) { return cudaGetErrorString(status); }

// Multiprocessors of `device`, or 0 where it cannot be read.
inline int multiprocessor_count(int device) {
  int count = 0;
  return cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) == cudaSuccess ? count : 0;
}

// The launch's own error (bad configuration, too much shared memory), not a later fault.
inline Status launch_status() { return cudaGetLastError(); }

// Lets `kernel` use more than the default 48 KiB of dynamic shared memory.
template <class Kernel>
Status allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

// Butterfly reductions over the 32 lanes of a warp: every lane ends with the same value.
BS_DEVICE float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

BS_DEVICE float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

}  // namespace bs::gpu

#else

#include "simt_emulation.h"

#endif

namespace bs::gpu {

constexpr int kWarpSize = 32;

BS_DEVICE int lane_id() { return static_cast<int>(threadIdx.x) % kWarpSize; }
BS_DEVICE int warp_id() { return static_cast<int>(threadIdx.x) / kWarpSize; }

// Sum over the whole block; `warp_totals` is shared memory for one float per warp. Every thread
// adds the warps' totals in the same order, so all get the same value.
BS_DEVICE float block_sum(float value, float* warp_totals) {
  value = warp_sum(value);
  if (lane_id() == 0) warp_totals[warp_id()] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) total += warp_totals[w];
  __syncthreads();  // warp_totals may be reused right after
  return total;
}

}  // namespace bs::gpu
