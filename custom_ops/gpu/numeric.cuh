// The element types the kernels take (float, bf16, fp16), read into float and written back
// with round-to-nearest-even; arithmetic is always float.
#pragma once

#include <algorithm>

#include "simt.cuh"

namespace bs::gpu {

// The dtype codes of the C entry points (kernel_api.cu) and the Paddle glue: the activations' types, and the
// 8-bit KV caches' (kv_rows.cuh).
enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3, kFp8E4M3 = 4 };

BS_HOST_DEVICE inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

BS_HOST_DEVICE inline float to_float(float value) { return value; }
BS_HOST_DEVICE inline float to_float(__nv_bfloat16 value) { return __bfloat162float(value); }
BS_HOST_DEVICE inline float to_float(__half value) { return __half2float(value); }

template <class T>
BS_HOST_DEVICE inline T from_float(float value);
template <>
BS_HOST_DEVICE inline float from_float<float>(float value) {
  return value;
}
template <>
BS_HOST_DEVICE inline __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16(value);
}
template <>
BS_HOST_DEVICE inline __half from_float<__half>(float value) {
  return __float2half(value);
}

// Returns body(T{}) with T the element type of `dtype` (an activations' type).
template <class Body>
Status dispatch_dtype(Dtype dtype, Body body) {
  switch (dtype) {
    case Dtype::kFloat32:
      return body(float{});
    case Dtype::kBFloat16:
      return body(__nv_bfloat16{});
    case Dtype::kFloat16:
      return body(__half{});
    default:
      return kInvalidArgument;
  }
}

// 16 bytes of T: the unit of the attention kernel's vector loads (rows must be 16-byte aligned).
template <class T>
struct Chunk {
  static constexpr int kElements = 16 / sizeof(T);
};

// out[0..kElements) = the chunk at `source` (16-byte aligned) as floats.
template <class T>
BS_DEVICE void load_chunk(const T* source, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(source);
  const T* elements = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Chunk<T>::kElements; ++i) out[i] = to_float(elements[i]);
}

}  // namespace bs::gpu
