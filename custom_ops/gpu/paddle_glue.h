// What the Paddle ops (*_ops.cu) share: element types, checks, the stream, the device's size.
// The ops only check shapes, allocate outputs and launch; the kernels are the Paddle-free headers.
#pragma once

#include "numeric.cuh"
#include "paddle/extension.h"

// The CPU ops' last attribute is the bits of the instruction-set extensions they may use
// (custom_ops/cpu/isa.h); the GPU ops take it so that the worker calls both alike, and ignore it.
#define BS_ISA_ATTR "isa: int"
using IsaAttr = int;

namespace bs::gpu::glue {

inline Dtype dtype_of(const paddle::Tensor& tensor) {
  switch (tensor.dtype()) {
    case paddle::DataType::FLOAT32:
      return Dtype::kFloat32;
    case paddle::DataType::BFLOAT16:
      return Dtype::kBFloat16;
    case paddle::DataType::FLOAT16:
      return Dtype::kFloat16;
    default:
      PD_THROW("expected a float32, bfloat16 or float16 tensor");
  }
}

inline void check_on_gpu(const paddle::Tensor& tensor, const char* name) {
  PD_CHECK(tensor.is_gpu(), name, " must be a GPU tensor");
}

inline void check_indices(const paddle::Tensor& tensor, const char* name) {
  check_on_gpu(tensor, name);
  PD_CHECK(tensor.dtype() == paddle::DataType::INT64, name, " must be int64");
}

inline void check_launched(Status status, const char* op) { PD_CHECK(status == kSuccess, op, ": ", status_text(status)); }

template <class T>
const T* pointer(const paddle::Tensor& tensor) {
  return reinterpret_cast<const T*>(tensor.data());
}

template <class T>
T* mutable_pointer(paddle::Tensor& tensor) {
  return reinterpret_cast<T*>(tensor.data());
}

// Multiprocessors of the tensor's device (the attention's split choice), asked once per device.
inline int multiprocessors(const paddle::Tensor& tensor) {
  constexpr int kMaxDevices = 64;
  static int counts[kMaxDevices] = {};
  const int device = tensor.place().GetDeviceId();
  PD_CHECK(device >= 0 && device < kMaxDevices, "unexpected device id");
  if (counts[device] == 0) counts[device] = multiprocessor_count(device);
  PD_CHECK(counts[device] > 0, "cannot read the device's multiprocessor count");
  return counts[device];
}

}  // namespace bs::gpu::glue
