// The linear layer: weights packed once at load (bs_linear_pack), then y = x @ W (+ bias) (bs_linear).
#include <vector>

#include "cpu_isa.h"
#include "linear_gemm.h"
#include "paddle/extension.h"

namespace {

void check_matrix(const paddle::Tensor& t, const char* name) {
  PD_CHECK(t.is_cpu() && t.dtype() == paddle::DataType::FLOAT32 && t.shape().size() == 2, name,
           " must be a 2-d float32 CPU tensor");
}

// weight [in, out] -> packed [panels, in, 16]: out_features rounded up to whole panels.
std::vector<paddle::Tensor> LinearPack(const paddle::Tensor& weight) {
  check_matrix(weight, "weight");
  const int64_t k = weight.shape()[0], n = weight.shape()[1];
  auto packed = paddle::empty({bs::linear::num_panels(n), k, bs::linear::kPanelWidth}, paddle::DataType::FLOAT32,
                              weight.place());
  bs::linear::pack_weight(weight.data<float>(), k, n, packed.data<float>());
  return {packed};
}

std::vector<paddle::Tensor> Linear(const paddle::Tensor& x, const paddle::Tensor& packed,
                                   const paddle::optional<paddle::Tensor>& bias, int64_t out_features, bool avx512) {
  bs::require_avx2_fma();
  check_matrix(x, "x");
  const int64_t m = x.shape()[0], k = x.shape()[1];
  PD_CHECK(packed.shape().size() == 3 && packed.shape()[0] == bs::linear::num_panels(out_features) &&
               packed.shape()[1] == k && packed.shape()[2] == bs::linear::kPanelWidth,
           "packed must come from bs_linear_pack of an [in_features, out_features] weight");
  const float* bias_data = nullptr;
  if (bias) {
    PD_CHECK(bias->numel() == out_features && bias->dtype() == paddle::DataType::FLOAT32,
             "bias must hold out_features float32 values");
    bias_data = bias->data<float>();
  }
  auto y = paddle::empty({m, out_features}, paddle::DataType::FLOAT32, x.place());
  bs::linear::gemm(bs::use_avx512(avx512), x.data<float>(), m, k, packed.data<float>(), out_features, bias_data,
                   y.data<float>());
  return {y};
}

}  // namespace

PD_BUILD_OP(bs_linear_pack).Inputs({"Weight"}).Outputs({"Packed"}).SetKernelFn(PD_KERNEL(LinearPack));

PD_BUILD_OP(bs_linear)
    .Inputs({"X", "Packed", paddle::Optional("Bias")})
    .Outputs({"Out"})
    .Attrs({"out_features: int64_t", "avx512: bool"})
    .SetKernelFn(PD_KERNEL(Linear));
