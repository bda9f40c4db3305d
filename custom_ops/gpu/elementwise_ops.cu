// Paddle ops over the row-wise kernels: RMSNorm with or without the fused residual add, SiLU-and-multiply.
#include <vector>

#include "activation_kernels.cuh"
#include "norm_kernels.cuh"
#include "paddle_glue.h"

namespace {

using namespace bs::gpu;

void check_rows(const paddle::Tensor& x, const char* name) {
  glue::check_on_gpu(x, name);
  PD_CHECK(x.shape().size() == 2, name, " must be 2-d");
}

std::vector<paddle::Tensor> norm(const paddle::Tensor& x, const paddle::Tensor* residual, const paddle::Tensor& weight,
                                 float eps) {
  check_rows(x, "x");
  const int64_t rows = x.shape()[0], width = x.shape()[1];
  PD_CHECK(weight.numel() == width && weight.dtype() == x.dtype(), "weight must be [width] of x's dtype");
  if (residual != nullptr) PD_CHECK(residual->shape() == x.shape() && residual->dtype() == x.dtype(), "residual must match x");
  auto out = paddle::empty({rows, width}, x.dtype(), x.place());
  auto summed = residual != nullptr ? paddle::empty({rows, width}, x.dtype(), x.place()) : paddle::Tensor();
  const Status status = dispatch_dtype(glue::dtype_of(x), [&](auto tag) {
    using T = decltype(tag);
    const AddRmsNormParams<T> p{glue::pointer<T>(x),
                                residual != nullptr ? glue::pointer<T>(*residual) : nullptr,
                                glue::pointer<T>(weight),
                                glue::mutable_pointer<T>(out),
                                residual != nullptr ? glue::mutable_pointer<T>(summed) : nullptr,
                                rows,
                                width,
                                eps};
    return launch_add_rms_norm(p, x.stream());
  });
  glue::check_launched(status, "bs_add_rms_norm");
  if (residual == nullptr) return {out};
  return {out, summed};
}

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& weight, float eps, IsaAttr) {
  return norm(x, nullptr, weight, eps);
}

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& residual,
                                       const paddle::Tensor& weight, float eps, IsaAttr) {
  return norm(x, &residual, weight, eps);
}

std::vector<paddle::Tensor> SiluAndMul(const paddle::Tensor& gate_up, IsaAttr) {
  check_rows(gate_up, "gate_up");
  PD_CHECK(gate_up.shape()[1] % 2 == 0, "gate_up must hold gate and up halves");
  const int64_t rows = gate_up.shape()[0], width = gate_up.shape()[1] / 2;
  auto out = paddle::empty({rows, width}, gate_up.dtype(), gate_up.place());
  const Status status = dispatch_dtype(glue::dtype_of(gate_up), [&](auto tag) {
    using T = decltype(tag);
    const SiluAndMulParams<T> p{glue::pointer<T>(gate_up), glue::mutable_pointer<T>(out), rows, width};
    return launch_silu_and_mul(p, gate_up.stream());
  });
  glue::check_launched(status, "bs_silu_and_mul");
  return {out};
}

}  // namespace

PD_BUILD_OP(bs_rms_norm)
    .Inputs({"X", "Weight"})
    .Outputs({"Out"})
    .Attrs({"eps: float", BS_ISA_ATTR})
    .SetKernelFn(PD_KERNEL(RmsNorm));

PD_BUILD_OP(bs_add_rms_norm)
    .Inputs({"X", "Residual", "Weight"})
    .Outputs({"Out", "Summed"})
    .Attrs({"eps: float", BS_ISA_ATTR})
    .SetKernelFn(PD_KERNEL(AddRmsNorm));

PD_BUILD_OP(bs_silu_and_mul)
    .Inputs({"GateUp"})
    .Outputs({"Out"})
    .Attrs({BS_ISA_ATTR})
    .SetKernelFn(PD_KERNEL(SiluAndMul));
