// Row-wise ops: fused residual add + RMSNorm, SiLU-and-multiply on the fused gate|up output, and each row's
// argmax (greedy sampling over the logits).
#include <vector>

#include "cpu_isa.h"
#include "kernel_set.h"
#include "paddle/extension.h"
#include "row_ops.h"

namespace {

void check_rows(const paddle::Tensor& x, const char* name) {
  PD_CHECK(x.is_cpu() && x.dtype() == paddle::DataType::FLOAT32 && x.shape().size() == 2,
           name, " must be a 2-d float32 CPU tensor");
}

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& weight, float eps, int isa) {
  check_rows(x, "x");
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa));
  const int64_t rows = x.shape()[0], width = x.shape()[1];
  PD_CHECK(weight.numel() == width, "weight must have one entry per column");
  auto out = paddle::empty({rows, width}, paddle::DataType::FLOAT32, x.place());
  bs::rms_norm_rows(kernels, x.data<float>(), nullptr, weight.data<float>(), out.data<float>(), nullptr, rows, width, eps);
  return {out};
}

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& residual,
                                       const paddle::Tensor& weight, float eps, int isa) {
  check_rows(x, "x");
  PD_CHECK(residual.shape() == x.shape(), "residual must have the shape of x");
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa));
  const int64_t rows = x.shape()[0], width = x.shape()[1];
  PD_CHECK(weight.numel() == width, "weight must have one entry per column");
  auto out = paddle::empty({rows, width}, paddle::DataType::FLOAT32, x.place());
  auto summed = paddle::empty({rows, width}, paddle::DataType::FLOAT32, x.place());
  bs::rms_norm_rows(kernels, x.data<float>(), residual.data<float>(), weight.data<float>(), out.data<float>(),
                    summed.data<float>(), rows, width, eps);
  return {out, summed};
}

std::vector<paddle::Tensor> SiluAndMul(const paddle::Tensor& gate_up, int isa) {
  check_rows(gate_up, "gate_up");
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa));
  const int64_t rows = gate_up.shape()[0], width = gate_up.shape()[1] / 2;
  PD_CHECK(gate_up.shape()[1] % 2 == 0, "gate_up must hold gate and up halves");
  auto out = paddle::empty({rows, width}, paddle::DataType::FLOAT32, gate_up.place());
  bs::silu_and_mul_rows(kernels, gate_up.data<float>(), out.data<float>(), rows, width);
  return {out};
}

std::vector<paddle::Tensor> ArgmaxRows(const paddle::Tensor& x, int isa) {
  check_rows(x, "x");
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa));
  const int64_t rows = x.shape()[0], width = x.shape()[1];
  PD_CHECK(width > 0, "x must have columns");
  auto out = paddle::empty({rows}, paddle::DataType::INT64, x.place());
  const float* values = x.data<float>();
  int64_t* index = out.data<int64_t>();
#pragma omp parallel for schedule(static) if (rows * width >= bs::kParallelFloats)
  for (int64_t r = 0; r < rows; ++r) index[r] = kernels.argmax_row(values + r * width, width);
  return {out};
}

}  // namespace

PD_BUILD_OP(bs_argmax_rows)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"isa: int"})
    .SetKernelFn(PD_KERNEL(ArgmaxRows));

PD_BUILD_OP(bs_rms_norm)
    .Inputs({"X", "Weight"})
    .Outputs({"Out"})
    .Attrs({"eps: float", "isa: int"})
    .SetKernelFn(PD_KERNEL(RmsNorm));

PD_BUILD_OP(bs_add_rms_norm)
    .Inputs({"X", "Residual", "Weight"})
    .Outputs({"Out", "Summed"})
    .Attrs({"eps: float", "isa: int"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm));

PD_BUILD_OP(bs_silu_and_mul)
    .Inputs({"GateUp"})
    .Outputs({"Out"})
    .Attrs({"isa: int"})
    .SetKernelFn(PD_KERNEL(SiluAndMul));
