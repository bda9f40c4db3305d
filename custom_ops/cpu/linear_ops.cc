// The linear layer: weights packed once at load (bs_linear_pack*, weight_format.h), then y = x @ W (+ bias)
// (bs_linear), and columns of a packed weight read back as rows (bs_linear_columns: a tied embedding).
#include <vector>

#include "cpu_isa.h"
#include "linear_gemm.h"
#include "linear_onednn.h"
#include "paddle/extension.h"
#include "weight_pack.h"

namespace {

using bs::linear::Format;

void check_matrix(const paddle::Tensor& t, paddle::DataType dtype, const char* name) {
  PD_CHECK(t.is_cpu() && t.dtype() == dtype && t.shape().size() == 2, name, " must be a 2-d CPU tensor of the ",
           "expected dtype");
}

Format format_of(int id) {
  PD_CHECK(bs::linear::is_format(id), "unknown weight format ", id);
  return static_cast<Format>(id);
}

paddle::Tensor empty_packed(Format format, int64_t k, int64_t n, const paddle::Place& place) {
  return paddle::empty({bs::linear::num_panels(n), bs::linear::panel_bytes(format, k)}, paddle::DataType::UINT8,
                       place);
}

void check_packed(const paddle::Tensor& packed, Format format, int64_t k, int64_t n) {
  PD_CHECK(packed.dtype() == paddle::DataType::UINT8 && packed.shape().size() == 2 &&
               packed.shape()[0] == bs::linear::num_panels(n) && packed.shape()[1] == bs::linear::panel_bytes(format, k),
           "packed must come from bs_linear_pack* of a weight of [in_features, out_features] in this format");
}

// weight [in, out] fp32 -> F32 or BF16 panels.
std::vector<paddle::Tensor> LinearPack(const paddle::Tensor& weight, int format_id) {
  check_matrix(weight, paddle::DataType::FLOAT32, "weight");
  const Format format = format_of(format_id);
  PD_CHECK(bs::linear::packs_from<bs::linear::DenseWeights>(format), "bs_linear_pack packs F32 or BF16");
  const int64_t k = weight.shape()[0], n = weight.shape()[1];
  auto packed = empty_packed(format, k, n, weight.place());
  bs::linear::pack(format, bs::linear::DenseWeights{weight.data<float>(), n}, k, n, packed.data<uint8_t>());
  return {packed};
}

// q [in, out] int8 and one scale per output column -> INT8 panels.
std::vector<paddle::Tensor> LinearPackInt8(const paddle::Tensor& q, const paddle::Tensor& scales) {
  check_matrix(q, paddle::DataType::INT8, "q");
  const int64_t k = q.shape()[0], n = q.shape()[1];
  PD_CHECK(scales.dtype() == paddle::DataType::FLOAT32 && scales.numel() == n, "one float32 scale per column");
  auto packed = empty_packed(Format::kInt8, k, n, q.place());
  bs::linear::pack(Format::kInt8, bs::linear::Int8Weights{q.data<int8_t>(), scales.data<float>(), n}, k, n,
                   packed.data<uint8_t>());
  return {packed};
}

// GGUF blocks as stored, [out_features, row bytes] uint8 -> Q panels.
std::vector<paddle::Tensor> LinearPackGguf(const paddle::Tensor& rows, int format_id, int64_t in_features) {
  check_matrix(rows, paddle::DataType::UINT8, "rows");
  const Format format = format_of(format_id);
  PD_CHECK(bs::linear::packs_from<bs::linear::GgufRows>(format) && in_features % 32 == 0,
           "GGUF Q4_0, Q4_1 or Q8_0 rows of whole blocks");
  const int64_t n = rows.shape()[0], row_bytes = rows.shape()[1];
  PD_CHECK(row_bytes == bs::linear::gguf_row_bytes(format, in_features), "rows hold in_features values each");
  auto packed = empty_packed(format, in_features, n, rows.place());
  bs::linear::pack(format, bs::linear::GgufRows{rows.data<uint8_t>(), row_bytes}, in_features, n,
                   packed.data<uint8_t>());
  return {packed};
}

std::vector<paddle::Tensor> Linear(const paddle::Tensor& x, const paddle::Tensor& packed,
                                   const paddle::optional<paddle::Tensor>& bias, int64_t out_features, int format_id,
                                   int isa) {
  const bs::Isa resolved = bs::resolve_isa(isa);
  check_matrix(x, paddle::DataType::FLOAT32, "x");
  const Format format = format_of(format_id);
  const int64_t m = x.shape()[0], k = x.shape()[1];
  check_packed(packed, format, k, out_features);
  const float* bias_data = nullptr;
  if (bias) {
    PD_CHECK(bias->numel() == out_features && bias->dtype() == paddle::DataType::FLOAT32,
             "bias must hold out_features float32 values");
    bias_data = bias->data<float>();
  }
  auto y = paddle::empty({m, out_features}, paddle::DataType::FLOAT32, x.place());
  bs::linear::gemm(resolved, format, x.data<float>(), m, k, packed.data<uint8_t>(), out_features, bias_data,
                   y.data<float>());
  return {y};
}

// out[i] = column ids[i] of W [in_features, out_features], dequantized: the embedding rows of a tied lm_head.
std::vector<paddle::Tensor> LinearColumns(const paddle::Tensor& packed, const paddle::Tensor& ids,
                                          int64_t in_features, int64_t out_features, int format_id) {
  const Format format = format_of(format_id);
  check_packed(packed, format, in_features, out_features);
  PD_CHECK(ids.dtype() == paddle::DataType::INT64, "ids must be int64");
  const int64_t count = ids.numel();
  const int64_t* id = ids.data<int64_t>();
  for (int64_t i = 0; i < count; ++i) PD_CHECK(id[i] >= 0 && id[i] < out_features, "id outside the weight's columns");
  auto out = paddle::empty({count, in_features}, paddle::DataType::FLOAT32, packed.place());
  bs::linear::unpack_columns(format, packed.data<uint8_t>(), in_features, id, count, out.data<float>());
  return {out};
}

// [major, minor, patch] of the oneDNN that GEMMs of bf16 weights may run on (linear_onednn.h); zeros where this build
// has none. `any`: an input Paddle's op registry asks for, not read.
std::vector<paddle::Tensor> LinearOneDnnVersion(const paddle::Tensor& any) {
  const int version = bs::linear::onednn_available() ? bs::linear::onednn_version() : 0;
  auto out = paddle::empty({3}, paddle::DataType::INT32, paddle::CPUPlace());
  int32_t* parts = out.data<int32_t>();
  parts[0] = version / 10000, parts[1] = version / 100 % 100, parts[2] = version % 100;
  return {out};
}

}  // namespace

PD_BUILD_OP(bs_linear_onednn_version)
    .Inputs({"Any"})
    .Outputs({"Version"})
    .SetKernelFn(PD_KERNEL(LinearOneDnnVersion));

PD_BUILD_OP(bs_linear_pack)
    .Inputs({"Weight"})
    .Outputs({"Packed"})
    .Attrs({"format: int"})
    .SetKernelFn(PD_KERNEL(LinearPack));

PD_BUILD_OP(bs_linear_pack_int8).Inputs({"Q", "Scales"}).Outputs({"Packed"}).SetKernelFn(PD_KERNEL(LinearPackInt8));

PD_BUILD_OP(bs_linear_pack_gguf)
    .Inputs({"Rows"})
    .Outputs({"Packed"})
    .Attrs({"format: int", "in_features: int64_t"})
    .SetKernelFn(PD_KERNEL(LinearPackGguf));

PD_BUILD_OP(bs_linear)
    .Inputs({"X", "Packed", paddle::Optional("Bias")})
    .Outputs({"Out"})
    .Attrs({"out_features: int64_t", "format: int", "isa: int"})
    .SetKernelFn(PD_KERNEL(Linear));

PD_BUILD_OP(bs_linear_columns)
    .Inputs({"Packed", "Ids"})
    .Outputs({"Out"})
    .Attrs({"in_features: int64_t", "out_features: int64_t", "format: int"})
    .SetKernelFn(PD_KERNEL(LinearColumns));
