// Row-wise ops: fused residual add + RMSNorm, SiLU-and-multiply on the fused gate|up output, each row's
// argmax (greedy sampling over the logits) and each row's draw without top_k/top_p (temperature, min_p).
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

// Paddle's CPU ops for this draw (divide, softmax, cast, cumsum over [64, 49152]) run on one thread: 36 ms for
// 64 rows, as long as the model's step (2-core EPYC); this op is one pass of exp over each row, the rows in parallel.
std::vector<paddle::Tensor> SampleRows(const paddle::Tensor& logits, const paddle::Tensor& params, int isa) {
  check_rows(logits, "logits");
  const int64_t rows = logits.shape()[0], width = logits.shape()[1];
  PD_CHECK(width > 0, "logits must have columns");
  PD_CHECK(params.is_cpu() && params.dtype() == paddle::DataType::FLOAT64 && params.shape().size() == 2 &&
               params.shape()[0] == rows && params.shape()[1] == 3,
           "params must be float64 [rows, 3]: temperature, min_p, uniform");
  const double* table = params.data<double>();
  for (int64_t r = 0; r < rows; ++r) {
    const double temperature = table[3 * r], min_p = table[3 * r + 1], uniform = table[3 * r + 2];
    PD_CHECK(temperature > 0.0 && min_p >= 0.0 && min_p <= 1.0 && uniform >= 0.0 && uniform < 1.0,
             "row ", r, ": a draw needs temperature > 0, min_p in [0, 1] and uniform in [0, 1)");
  }
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa));
  auto out = paddle::empty({rows}, paddle::DataType::INT64, logits.place());
  const float* values = logits.data<float>();
  int64_t* index = out.data<int64_t>();
#pragma omp parallel if (rows > 1 && rows * width >= bs::kParallelFloats)
  {
    std::vector<float> scratch(bs::sample_scratch_floats(width));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      index[r] = kernels.sample_row(values + r * width, width, static_cast<float>(table[3 * r]),
                                    static_cast<float>(table[3 * r + 1]), table[3 * r + 2], scratch.data());
    }
  }
  return {out};
}

}  // namespace

PD_BUILD_OP(bs_sample_rows)
    .Inputs({"Logits", "Params"})
    .Outputs({"Out"})
    .Attrs({"isa: int"})
    .SetKernelFn(PD_KERNEL(SampleRows));

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
