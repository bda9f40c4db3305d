// One Llama-family decoder layer in one op (bs_decoder_layer): residual add + RMSNorm, the fused q|k|v
// projection, rotary embedding + KV-cache write, paged attention, the o projection, residual add + RMSNorm,
// gate|up, SiLU-and-multiply and down, through the same kernels as the single ops. A Paddle custom-op call
// costs ~20 us; a decode step of one sequence made 9 of them per layer, more than its kernels took.
#include <vector>

#include "cpu_isa.h"
#include "kernel_set.h"
#include "linear_gemm.h"
#include "paddle/extension.h"
#include "paged_attention.h"
#include "row_ops.h"

namespace {

using bs::linear::Format;

// One projection's packed weight and bias, checked against y[tokens, n] = x[tokens, k] @ W.
struct Projection {
  Format format;
  const uint8_t* packed;
  const float* bias;
  int64_t k, n;
};

Projection projection(const paddle::Tensor& packed, const paddle::optional<paddle::Tensor>& bias, int format_id,
                      int64_t k, int64_t n, const char* name) {
  PD_CHECK(bs::linear::is_format(format_id), name, ": unknown weight format ", format_id);
  const Format format = static_cast<Format>(format_id);
  PD_CHECK(packed.dtype() == paddle::DataType::UINT8 && packed.shape().size() == 2 &&
               packed.shape()[0] == bs::linear::num_panels(n) && packed.shape()[1] == bs::linear::panel_bytes(format, k),
           name, " must be packed from a [", k, ", ", n, "] weight in its format");
  PD_CHECK(!bias || (bias->dtype() == paddle::DataType::FLOAT32 && bias->numel() == n), name, ": one bias per output");
  return {format, packed.data<uint8_t>(), bias ? bias->data<float>() : nullptr, k, n};
}

paddle::Tensor apply(const bs::Isa& isa, const Projection& w, const paddle::Tensor& x) {
  auto y = paddle::empty({x.shape()[0], w.n}, paddle::DataType::FLOAT32, x.place());
  bs::linear::gemm(isa, w.format, x.data<float>(), x.shape()[0], w.k, w.packed, w.n, w.bias, y.data<float>());
  return y;
}

std::vector<paddle::Tensor> DecoderLayer(
    const paddle::Tensor& hidden, const paddle::optional<paddle::Tensor>& residual, const paddle::Tensor& input_norm,
    const paddle::Tensor& post_norm, const paddle::Tensor& qkv_weight, const paddle::Tensor& o_weight,
    const paddle::Tensor& gate_up_weight, const paddle::Tensor& down_weight,
    const paddle::optional<paddle::Tensor>& qkv_bias, const paddle::optional<paddle::Tensor>& o_bias,
    const paddle::optional<paddle::Tensor>& gate_up_bias, const paddle::optional<paddle::Tensor>& down_bias,
    paddle::Tensor& key_cache, paddle::Tensor& value_cache, const paddle::Tensor& positions,
    const paddle::Tensor& slot_mapping, const paddle::Tensor& query_start, const paddle::Tensor& context_lens,
    const paddle::Tensor& block_table, const paddle::Tensor& cos, const paddle::Tensor& sin,
    const std::vector<int>& formats, int num_heads, int num_kv_heads, int64_t intermediate_size, float eps,
    int query_tile, int isa_bits) {
  const bs::Isa isa = bs::resolve_isa(isa_bits);
  const auto& kernels = bs::kernels_for(isa);
  PD_CHECK(hidden.is_cpu() && hidden.dtype() == paddle::DataType::FLOAT32 && hidden.shape().size() == 2,
           "hidden must be a 2-d float32 CPU tensor");
  const int64_t tokens = hidden.shape()[0], width = hidden.shape()[1];
  PD_CHECK(!residual || residual->shape() == hidden.shape(), "residual must have the shape of hidden");
  PD_CHECK(input_norm.numel() == width && post_norm.numel() == width, "one norm weight per hidden feature");
  bs::KvCaches caches = bs::kv_caches(key_cache, value_cache);
  PD_CHECK(caches.num_kv_heads == num_kv_heads, "the caches hold num_kv_heads heads");
  PD_CHECK(formats.size() == 4, "one weight format per projection: qkv, o, gate_up, down");
  const int64_t head_dim = caches.head_dim, attention_width = num_heads * head_dim;
  const Projection qkv = projection(qkv_weight, qkv_bias, formats[0], width,
                                    (num_heads + 2 * num_kv_heads) * head_dim, "qkv");
  const Projection o = projection(o_weight, o_bias, formats[1], attention_width, width, "o");
  const Projection gate_up = projection(gate_up_weight, gate_up_bias, formats[2], width, 2 * intermediate_size, "gate_up");
  const Projection down = projection(down_weight, down_bias, formats[3], intermediate_size, width, "down");
  PD_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens, "one position and slot per token");
  PD_CHECK(cos.shape()[1] == head_dim && sin.shape() == cos.shape(), "cos/sin must be [positions, head_dim]");
  const int64_t num_requests = context_lens.numel();
  PD_CHECK(query_start.numel() == num_requests + 1 && block_table.shape()[0] == num_requests, "one row per request");
  const auto place = hidden.place();

  auto normed = paddle::empty({tokens, width}, paddle::DataType::FLOAT32, place);
  auto summed = residual ? paddle::empty({tokens, width}, paddle::DataType::FLOAT32, place) : hidden.copy_to(place, true);
  bs::rms_norm_rows(kernels, hidden.data<float>(), residual ? residual->data<float>() : nullptr, input_norm.data<float>(),
                    normed.data<float>(), residual ? summed.data<float>() : nullptr, tokens, width, eps);
  const auto qkv_out = apply(isa, qkv, normed);
  auto query = paddle::empty({tokens, num_heads, head_dim}, paddle::DataType::FLOAT32, place);
  bs::rope_write_kv(kernels, qkv_out.data<float>(), {positions.data<int64_t>(), slot_mapping.data<int64_t>(), tokens},
                    cos.data<float>(), sin.data<float>(), cos.shape()[0], num_heads, caches, query.data<float>());
  auto attended = paddle::empty({tokens, attention_width}, paddle::DataType::FLOAT32, place);
  const bs::StepRequests requests{query_start.data<int64_t>(), context_lens.data<int64_t>(), num_requests,
                                  block_table.data<int64_t>(), block_table.shape()[1]};
  bs::paged_attention(kernels, query.data<float>(), tokens, num_heads, caches, requests, query_tile,
                      attended.data<float>());
  const auto o_out = apply(isa, o, attended);
  auto post_summed = paddle::empty({tokens, width}, paddle::DataType::FLOAT32, place);
  bs::rms_norm_rows(kernels, o_out.data<float>(), summed.data<float>(), post_norm.data<float>(), normed.data<float>(),
                    post_summed.data<float>(), tokens, width, eps);
  const auto gate_up_out = apply(isa, gate_up, normed);
  auto activated = paddle::empty({tokens, intermediate_size}, paddle::DataType::FLOAT32, place);
  bs::silu_and_mul_rows(kernels, gate_up_out.data<float>(), activated.data<float>(), tokens, intermediate_size);
  return {apply(isa, down, activated), post_summed};
}

}  // namespace

PD_BUILD_OP(bs_decoder_layer)
    .Inputs({"Hidden", paddle::Optional("Residual"), "InputNorm", "PostNorm", "QkvWeight", "OWeight", "GateUpWeight",
             "DownWeight", paddle::Optional("QkvBias"), paddle::Optional("OBias"), paddle::Optional("GateUpBias"),
             paddle::Optional("DownBias"), "KeyCache", "ValueCache", "Positions", "SlotMapping", "QueryStart",
             "ContextLens", "BlockTable", "Cos", "Sin"})
    .Outputs({"HiddenOut", "ResidualOut", "KeyCacheOut", "ValueCacheOut"})
    .SetInplaceMap({{"KeyCache", "KeyCacheOut"}, {"ValueCache", "ValueCacheOut"}})
    .Attrs({"formats: std::vector<int>", "num_heads: int", "num_kv_heads: int", "intermediate_size: int64_t",
            "eps: float", "query_tile: int", "isa: int"})
    .SetKernelFn(PD_KERNEL(DecoderLayer));
