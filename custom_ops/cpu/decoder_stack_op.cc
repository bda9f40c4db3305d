// Every Llama-family decoder layer of a step in one op (bs_decoder_stack). Per layer: residual add + RMSNorm,
// the fused q|k|v projection, rotary embedding + KV-cache write, paged attention, the o projection, residual
// add + RMSNorm, gate|up, SiLU-and-multiply and down, through the same kernels as the single ops; at the end
// the last layer's output plus its residual. A Paddle custom-op call costs ~12 us with a layer's 21 inputs,
// and each of a layer's 11 outputs and intermediates another ~0.6 us to allocate: one call per layer spent
// ~0.55 ms of a one-sequence decode step (~4 ms) on these, one call for the stack ~0.1 ms (its ~240
// tensors) plus the step's buffers once.
// With time_stages, the op also clocks each stage of every layer (StageSeconds: seconds per stage, summed over
// the layers; zeros without it), so that a benchmark sees where the fused step goes.
#include <chrono>
#include <initializer_list>
#include <vector>

#include "cpu_isa.h"
#include "kernel_set.h"
#include "linear_gemm.h"
#include "paddle/extension.h"
#include "paged_attention.h"
#include "row_ops.h"

namespace {

using bs::linear::Format;
using Tensors = std::vector<paddle::Tensor>;
using OptionalTensors = paddle::optional<Tensors>;

// One projection's packed weight and bias, checked against y[tokens, n] = x[tokens, k] @ W.
struct Projection {
  Format format;
  const uint8_t* packed;
  const float* bias;
  int64_t k, n;
};

Projection projection(const paddle::Tensor& packed, const OptionalTensors& biases, size_t layer, int format_id,
                      int64_t k, int64_t n, const char* name) {
  PD_CHECK(bs::linear::is_format(format_id), name, ": unknown weight format ", format_id);
  const Format format = static_cast<Format>(format_id);
  PD_CHECK(packed.dtype() == paddle::DataType::UINT8 && packed.shape().size() == 2 &&
               packed.shape()[0] == bs::linear::num_panels(n) && packed.shape()[1] == bs::linear::panel_bytes(format, k),
           name, " of layer ", layer, " must be packed from a [", k, ", ", n, "] weight in its format");
  const paddle::Tensor* bias = biases ? &biases->at(layer) : nullptr;
  PD_CHECK(!bias || (bias->dtype() == paddle::DataType::FLOAT32 && bias->numel() == n), name, " of layer ", layer,
           ": one bias per output");
  return {format, packed.data<uint8_t>(), bias ? bias->data<float>() : nullptr, k, n};
}

void apply(const bs::Isa& isa, const Projection& w, const float* x, int64_t rows, float* y) {
  bs::linear::gemm(isa, w.format, x, rows, w.k, w.packed, w.n, w.bias, y);
}

// A layer's stages, in StageSeconds' order (the input and post-attention norms are one stage).
enum Stage { kNorms, kQkv, kRopeWrite, kAttention, kO, kGateUp, kSilu, kDown, kNumStages };

// Wall time per stage: each lap adds the time since the last to its stage. The stages run one after another on
// the calling thread (each parallel inside), so the laps are the stages' times. Off: reads no clock.
class StageClock {
 public:
  explicit StageClock(double* seconds) : seconds_(seconds), last_(now()) {}
  void lap(Stage stage) {
    if (seconds_ == nullptr) return;
    const auto at = now();
    seconds_[stage] += std::chrono::duration<double>(at - last_).count();
    last_ = at;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  double* seconds_;
  std::chrono::steady_clock::time_point last_;
};

float* buffer(std::vector<paddle::Tensor>& owned, int64_t rows, int64_t width, const paddle::Place& place) {
  owned.push_back(paddle::empty({rows, width}, paddle::DataType::FLOAT32, place));
  return owned.back().data<float>();
}

std::vector<paddle::Tensor> DecoderStack(
    const paddle::Tensor& hidden, const Tensors& input_norms, const Tensors& post_norms, const Tensors& qkv_weights,
    const Tensors& o_weights, const Tensors& gate_up_weights, const Tensors& down_weights,
    const OptionalTensors& qkv_biases, const OptionalTensors& o_biases, const OptionalTensors& gate_up_biases,
    const OptionalTensors& down_biases, Tensors& key_caches, Tensors& value_caches, const paddle::Tensor& positions,
    const paddle::Tensor& slot_mapping, const paddle::Tensor& query_start, const paddle::Tensor& context_lens,
    const paddle::Tensor& block_table, const paddle::Tensor& cos, const paddle::Tensor& sin,
    const std::vector<int>& formats, int num_heads, int num_kv_heads, int64_t intermediate_size, float eps,
    int query_tile, int isa_bits, bool time_stages) {
  const bs::Isa isa = bs::resolve_isa(isa_bits);
  const auto& kernels = bs::kernels_for(isa);
  PD_CHECK(hidden.is_cpu() && hidden.dtype() == paddle::DataType::FLOAT32 && hidden.shape().size() == 2,
           "hidden must be a 2-d float32 CPU tensor");
  const int64_t tokens = hidden.shape()[0], width = hidden.shape()[1];
  const size_t num_layers = input_norms.size();
  PD_CHECK(num_layers > 0, "no layers");
  for (const Tensors* per_layer : std::initializer_list<const Tensors*>{&post_norms, &qkv_weights, &o_weights, &gate_up_weights, &down_weights, &key_caches,
                                                                    &value_caches}) {
    PD_CHECK(per_layer->size() == num_layers, "one norm, weight and cache of each kind per layer");
  }
  for (const OptionalTensors* biases : {&qkv_biases, &o_biases, &gate_up_biases, &down_biases}) {
    PD_CHECK(!*biases || (*biases)->size() == num_layers, "biases of a projection: one per layer or none");
  }
  PD_CHECK(formats.size() == 4 * num_layers, "one weight format per layer and projection: qkv, o, gate_up, down");
  PD_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens, "one position and slot per token");
  const int64_t num_requests = context_lens.numel();
  PD_CHECK(query_start.numel() == num_requests + 1 && block_table.shape()[0] == num_requests, "one row per request");
  const int64_t head_dim = key_caches[0].shape().size() == 4 ? key_caches[0].shape()[3] : 0;
  PD_CHECK(cos.shape()[1] == head_dim && sin.shape() == cos.shape(), "cos/sin must be [positions, head_dim]");
  const int64_t attention_width = num_heads * head_dim, qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;

  struct Layer {
    const float *input_norm, *post_norm;
    Projection qkv, o, gate_up, down;
    bs::KvCaches caches;
  };
  std::vector<Layer> layers;
  layers.reserve(num_layers);
  for (size_t l = 0; l < num_layers; ++l) {
    PD_CHECK(input_norms[l].numel() == width && post_norms[l].numel() == width, "one norm weight per hidden feature");
    const bs::KvCaches caches = bs::kv_caches(key_caches[l], value_caches[l]);
    PD_CHECK(caches.num_kv_heads == num_kv_heads && caches.head_dim == head_dim,
             "every layer's caches hold num_kv_heads heads of one head_dim");
    layers.push_back({input_norms[l].data<float>(), post_norms[l].data<float>(),
                      projection(qkv_weights[l], qkv_biases, l, formats[4 * l + 0], width, qkv_width, "qkv"),
                      projection(o_weights[l], o_biases, l, formats[4 * l + 1], attention_width, width, "o"),
                      projection(gate_up_weights[l], gate_up_biases, l, formats[4 * l + 2], width, 2 * intermediate_size, "gate_up"),
                      projection(down_weights[l], down_biases, l, formats[4 * l + 3], intermediate_size, width, "down"),
                      caches});
  }

  const auto place = hidden.place();
  auto out = paddle::empty({tokens, width}, paddle::DataType::FLOAT32, place);
  std::vector<paddle::Tensor> owned;  // the step's buffers, reused by every layer
  float* normed = buffer(owned, tokens, width, place);
  float* summed = buffer(owned, tokens, width, place);       // the layer's input + residual
  float* post_summed = buffer(owned, tokens, width, place);  // + attention: the residual of the next layer
  float* down_out = buffer(owned, tokens, width, place);     // the layer's output
  float* o_out = buffer(owned, tokens, width, place);
  float* qkv_out = buffer(owned, tokens, qkv_width, place);
  float* query = buffer(owned, tokens, attention_width, place);
  float* attended = buffer(owned, tokens, attention_width, place);
  float* gate_up_out = buffer(owned, tokens, 2 * intermediate_size, place);
  float* activated = buffer(owned, tokens, intermediate_size, place);
  auto stage_seconds = paddle::full({kNumStages}, 0.0, paddle::DataType::FLOAT64, place);
  StageClock clock(time_stages ? stage_seconds.data<double>() : nullptr);
  const bs::StepTokens step_tokens{positions.data<int64_t>(), slot_mapping.data<int64_t>(), tokens};
  const bs::StepRequests requests{query_start.data<int64_t>(), context_lens.data<int64_t>(), num_requests,
                                  block_table.data<int64_t>(), block_table.shape()[1]};

  for (size_t l = 0; l < num_layers; ++l) {
    Layer& layer = layers[l];
    // Layer 0's residual is its input; a later layer's is the one before's post-attention sum.
    const float* residual = hidden.data<float>();
    if (l == 0) {
      bs::rms_norm_rows(kernels, residual, nullptr, layer.input_norm, normed, nullptr, tokens, width, eps);
    } else {
      bs::rms_norm_rows(kernels, down_out, post_summed, layer.input_norm, normed, summed, tokens, width, eps);
      residual = summed;
    }
    clock.lap(kNorms);
    apply(isa, layer.qkv, normed, tokens, qkv_out);
    clock.lap(kQkv);
    bs::rope_write_kv(kernels, qkv_out, step_tokens, cos.data<float>(), sin.data<float>(), cos.shape()[0], num_heads,
                      layer.caches, query);
    clock.lap(kRopeWrite);
    bs::paged_attention(kernels, query, tokens, num_heads, layer.caches, requests, query_tile, attended);
    clock.lap(kAttention);
    apply(isa, layer.o, attended, tokens, o_out);
    clock.lap(kO);
    bs::rms_norm_rows(kernels, o_out, residual, layer.post_norm, normed, post_summed, tokens, width, eps);
    clock.lap(kNorms);
    const Projection& gate_up = layer.gate_up;
    if (bs::linear::gemm_silu_and_mul(isa, gate_up.format, normed, tokens, gate_up.k, gate_up.packed, gate_up.n,
                                      gate_up.bias, activated)) {
      clock.lap(kGateUp);  // the SiLU inside
    } else {
      apply(isa, gate_up, normed, tokens, gate_up_out);
      clock.lap(kGateUp);
      bs::silu_and_mul_rows(kernels, gate_up_out, activated, tokens, intermediate_size);
    }
    clock.lap(kSilu);
    apply(isa, layer.down, activated, tokens, down_out);
    clock.lap(kDown);
  }
  float* result = out.data<float>();
  for (int64_t i = 0; i < tokens * width; ++i) result[i] = down_out[i] + post_summed[i];
  return {out, stage_seconds};
}

}  // namespace

PD_BUILD_OP(bs_decoder_stack)
    .Inputs({"Hidden", paddle::Vec("InputNorms"), paddle::Vec("PostNorms"), paddle::Vec("QkvWeights"),
             paddle::Vec("OWeights"), paddle::Vec("GateUpWeights"), paddle::Vec("DownWeights"),
             paddle::Optional(paddle::Vec("QkvBiases")), paddle::Optional(paddle::Vec("OBiases")),
             paddle::Optional(paddle::Vec("GateUpBiases")), paddle::Optional(paddle::Vec("DownBiases")),
             paddle::Vec("KeyCaches"), paddle::Vec("ValueCaches"), "Positions", "SlotMapping", "QueryStart",
             "ContextLens", "BlockTable", "Cos", "Sin"})
    .Outputs({"HiddenOut", paddle::Vec("KeyCachesOut"), paddle::Vec("ValueCachesOut"), "StageSeconds"})
    .SetInplaceMap({{paddle::Vec("KeyCaches"), paddle::Vec("KeyCachesOut")},
                    {paddle::Vec("ValueCaches"), paddle::Vec("ValueCachesOut")}})
    .Attrs({"formats: std::vector<int>", "num_heads: int", "num_kv_heads: int", "intermediate_size: int64_t",
            "eps: float", "query_tile: int", "isa: int", "time_stages: bool"})
    .SetKernelFn(PD_KERNEL(DecoderStack));
