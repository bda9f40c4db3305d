// A Llama-family model's step from token ids to the final norm in one op (bs_decoder_stack): the embedding
// lookup of the step's ids, then per decoder layer: residual add + RMSNorm, the fused q|k|v projection, rotary
// embedding + KV-cache write, paged attention, the o projection, residual add + RMSNorm, gate|up,
// SiLU-and-multiply and down, through the same kernels as the single ops; at the end the final RMSNorm of the
// last layer's output plus its residual. A Paddle custom-op call costs ~12 us with a layer's 21 inputs,
// and each of a layer's 11 outputs and intermediates another ~0.6 us to allocate: one call per layer spent
// ~0.55 ms of a one-sequence decode step (~4 ms) on these. The embedding, the layers' norms, weights and caches
// and the final norm (~250 tensors) are checked and held once (bs_decoder_stack_hold, until
// bs_decoder_stack_release), so that a step's call passes a handle, the step's layout (ids, positions, slots,
// block tables: one tensor) and nothing per layer. The lookup and the final norm inside the op spare a step
// three Paddle calls around it (the ids tensor, the embedding and the final norm ops): 0.3-0.4 ms of a
// one-sequence gguf decode step on a 2-core EPYC, most of it their first touches of memory the weights
// had just streamed through.
// With time_stages, the op also clocks each stage of every layer (StageSeconds: seconds per stage, summed over
// the layers; zeros without it), so that a benchmark sees where the fused step goes.
#include <chrono>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cpu_isa.h"
#include "kernel_set.h"
#include "linear_gemm.h"
#include "paddle/extension.h"
#include "paged_attention.h"
#include "row_ops.h"
#include "weight_pack.h"

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

// A step's stages, in StageSeconds' order (the input, post-attention and final norms are one stage).
enum Stage { kEmbedding, kNorms, kQkv, kRopeWrite, kAttention, kO, kGateUp, kSilu, kDown, kNumStages };

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

// A model's decoder layers as the stack reads them: norms, packed weights, biases and KV caches, checked once
// (bs_decoder_stack_hold) and held until bs_decoder_stack_release. `tensors` keeps every pointer in `layers`
// valid; the caches are written in place, as bs_rope_write_kv writes them.
struct Layer {
  const float *input_norm, *post_norm;
  Projection qkv, o, gate_up, down;
  bs::KvCaches caches;
};
struct HeldStack {
  std::vector<paddle::Tensor> tensors;
  Projection embedding;  // the token embedding transposed, [hidden, vocab]: token t's row is column t
  std::vector<Layer> layers;
  const float* final_norm;
  int64_t width, head_dim, attention_width, qkv_width, intermediate_size;
  int num_heads, num_kv_heads;
};

// Held stacks by handle. A step's call names its stack by handle instead of passing ~250 tensors: Paddle's
// dispatch of those cost ~20 us per layer (0.6-0.7 ms of a one-sequence decode step; 0.05-0.1 ms for one layer).
std::mutex held_mutex;
std::unordered_map<int64_t, std::shared_ptr<HeldStack>> held_stacks;
int64_t next_handle = 1;

paddle::Tensor handle_tensor(int64_t handle) {
  auto tensor = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  tensor.data<int64_t>()[0] = handle;
  return tensor;
}

int64_t handle_of(const paddle::Tensor& handle) {
  PD_CHECK(handle.is_cpu() && handle.dtype() == paddle::DataType::INT64 && handle.numel() == 1,
           "a decoder stack handle is one int64 on the CPU");
  return handle.data<int64_t>()[0];
}

std::vector<paddle::Tensor> HoldDecoderStack(
    const paddle::Tensor& embedding, const paddle::Tensor& final_norm, const Tensors& input_norms,
    const Tensors& post_norms, const Tensors& qkv_weights, const Tensors& o_weights, const Tensors& gate_up_weights,
    const Tensors& down_weights, const OptionalTensors& qkv_biases, const OptionalTensors& o_biases,
    const OptionalTensors& gate_up_biases, const OptionalTensors& down_biases, const Tensors& key_caches,
    const Tensors& value_caches, const std::vector<int>& formats, int num_heads, int num_kv_heads,
    int64_t intermediate_size, int embedding_format, int64_t vocab_size) {
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
  PD_CHECK(num_heads > 0 && num_kv_heads > 0 && intermediate_size > 0 && vocab_size > 0,
           "bad head counts, intermediate or vocabulary size");
  auto stack = std::make_shared<HeldStack>();
  stack->width = input_norms[0].numel();
  stack->head_dim = bs::kv_caches(key_caches[0], value_caches[0]).head_dim;  // a scaled cache's rows are longer
  stack->attention_width = num_heads * stack->head_dim;
  stack->qkv_width = (num_heads + 2 * num_kv_heads) * stack->head_dim;
  stack->intermediate_size = intermediate_size;
  stack->num_heads = num_heads;
  stack->num_kv_heads = num_kv_heads;
  const int64_t width = stack->width, head_dim = stack->head_dim;
  stack->embedding = projection(embedding, OptionalTensors(), 0, embedding_format, width, vocab_size, "the embedding");
  PD_CHECK(final_norm.dtype() == paddle::DataType::FLOAT32 && final_norm.numel() == width,
           "the final norm is one float32 weight per hidden feature");
  stack->final_norm = final_norm.data<float>();
  stack->layers.reserve(num_layers);
  for (size_t l = 0; l < num_layers; ++l) {
    PD_CHECK(input_norms[l].dtype() == paddle::DataType::FLOAT32 && post_norms[l].dtype() == paddle::DataType::FLOAT32 &&
                 input_norms[l].numel() == width && post_norms[l].numel() == width,
             "one float32 norm weight per hidden feature");
    const bs::KvCaches caches = bs::kv_caches(key_caches[l], value_caches[l]);
    const bs::KvCaches& first = l == 0 ? caches : stack->layers[0].caches;
    PD_CHECK(caches.num_kv_heads == num_kv_heads && caches.head_dim == head_dim &&
                 caches.num_blocks == first.num_blocks && caches.block_size == first.block_size,
             "every layer's caches hold num_kv_heads heads of one head_dim, in as many blocks of one size");
    stack->layers.push_back(
        {input_norms[l].data<float>(), post_norms[l].data<float>(),
         projection(qkv_weights[l], qkv_biases, l, formats[4 * l + 0], width, stack->qkv_width, "qkv"),
         projection(o_weights[l], o_biases, l, formats[4 * l + 1], stack->attention_width, width, "o"),
         projection(gate_up_weights[l], gate_up_biases, l, formats[4 * l + 2], width, 2 * intermediate_size, "gate_up"),
         projection(down_weights[l], down_biases, l, formats[4 * l + 3], intermediate_size, width, "down"), caches});
  }
  stack->tensors = {embedding, final_norm};
  for (const Tensors* per_layer : {&input_norms, &post_norms, &qkv_weights, &o_weights, &gate_up_weights, &down_weights,
                                   &key_caches, &value_caches}) {
    stack->tensors.insert(stack->tensors.end(), per_layer->begin(), per_layer->end());
  }
  for (const OptionalTensors* biases : {&qkv_biases, &o_biases, &gate_up_biases, &down_biases}) {
    if (*biases) stack->tensors.insert(stack->tensors.end(), (*biases)->begin(), (*biases)->end());
  }
  std::lock_guard<std::mutex> lock(held_mutex);
  const int64_t handle = next_handle++;
  held_stacks.emplace(handle, std::move(stack));
  return {handle_tensor(handle)};
}

// Lets go of a held stack's tensors; Released is 1, or 0 where the handle held nothing (already released).
std::vector<paddle::Tensor> ReleaseDecoderStack(const paddle::Tensor& handle) {
  std::lock_guard<std::mutex> lock(held_mutex);
  return {handle_tensor(static_cast<int64_t>(held_stacks.erase(handle_of(handle))))};
}

std::vector<paddle::Tensor> DecoderStack(const paddle::Tensor& handle, const paddle::Tensor& layout,
                                         const paddle::Tensor& cos, const paddle::Tensor& sin, float eps,
                                         int query_tile, int isa_bits, bool time_stages) {
  std::shared_ptr<HeldStack> stack;  // held for the call, even if released meanwhile
  {
    std::lock_guard<std::mutex> lock(held_mutex);
    const auto found = held_stacks.find(handle_of(handle));
    PD_CHECK(found != held_stacks.end(), "no decoder stack is held under handle ", handle_of(handle));
    stack = found->second;
  }
  const bs::Isa isa = bs::resolve_isa(isa_bits);
  const auto& kernels = bs::kernels_for(isa);
  const bs::StepLayout step = bs::step_layout(layout);
  const int64_t tokens = step.tokens.count, width = stack->width;
  const Projection& embedding = stack->embedding;
  for (int64_t t = 0; t < tokens; ++t) {
    PD_CHECK(step.ids[t] >= 0 && step.ids[t] < embedding.n, "token id ", step.ids[t], " outside the vocabulary of ",
             embedding.n);
  }
  PD_CHECK(cos.shape()[1] == stack->head_dim && sin.shape() == cos.shape(), "cos/sin must be [positions, head_dim]");
  const int64_t attention_width = stack->attention_width, qkv_width = stack->qkv_width;
  const int64_t intermediate_size = stack->intermediate_size;
  const int num_heads = stack->num_heads;

  const auto place = paddle::CPUPlace();
  auto out = paddle::empty({tokens, width}, paddle::DataType::FLOAT32, place);
  std::vector<paddle::Tensor> owned;  // the step's buffers, reused by every layer
  float* embedded = buffer(owned, tokens, width, place);
  float* normed = buffer(owned, tokens, width, place);
  float* summed = buffer(owned, tokens, width, place);       // the layer's input + residual
  float* post_summed = buffer(owned, tokens, width, place);  // + attention: the residual of the next layer
  float* down_out = buffer(owned, tokens, width, place);     // the layer's output
  float* o_out = buffer(owned, tokens, width, place);
  float* qkv_out = buffer(owned, tokens, qkv_width, place);
  float* query = buffer(owned, tokens, attention_width, place);
  float* attended = buffer(owned, tokens, attention_width, place);
  float* gate_up_out = nullptr;  // the gate|up product, allocated where a layer's SiLU is not fused into its GEMM
  float* activated = buffer(owned, tokens, intermediate_size, place);
  auto stage_seconds = paddle::full({kNumStages}, 0.0, paddle::DataType::FLOAT64, place);
  StageClock clock(time_stages ? stage_seconds.data<double>() : nullptr);
  const bs::StepTokens& step_tokens = step.tokens;
  const bs::StepRequests& requests = step.requests;

  bs::linear::unpack_columns(embedding.format, embedding.packed, width, step.ids, tokens, embedded);
  clock.lap(kEmbedding);
  // The step's tokens and attention tiles, checked and planned once for every layer (their caches have one shape).
  const bs::KvCaches& shape = stack->layers[0].caches;
  bs::check_step_tokens(step_tokens, cos.shape()[0], shape.num_blocks * shape.block_size);
  const bs::AttentionPlan plan = bs::plan_attention(requests, tokens, num_heads, shape, query_tile);
  // A decode step's tiles rotate and write their own tokens (bs::DecodeRope): its rope + KV write stage is ~0,
  // the attention stage's time.
  const bs::DecodeRope decode_rope{&kernels, qkv_out, step_tokens, cos.data<float>(), sin.data<float>(), query};
  clock.lap(kAttention);
  // (Asking for a one-sequence decode's cached keys and values when each layer begins, so that its attention
  // finds them in L2, measured a loss: gguf, 100 pairs in one process, twice: attention 79 and 46 us less a
  // step, the asks 111 and 90 us more; step ratios 1.008 and 1.027.)
  // (Nor do the GEMMs of a layer ask for the next layer's keys and values so that its attention finds them in L3:
  // at 64 decodes in bf16, asked by the o, gate_up and down tiles (steps paired in one process), ~184 lines after
  // each register tile gave attention 0.67x but o and gate_up 1.25-1.3x, steps 1.046 (1.08-1.13 with other
  // prefetch hints); one line per step over k inside the tiles, attention 0.98-0.99x, steps 1.011 and 1.088. A
  // thread asking for lines that miss waits on the misses it may have outstanding, GEMM or attention alike.)
  for (size_t l = 0; l < stack->layers.size(); ++l) {
    Layer& layer = stack->layers[l];
    // Layer 0's residual is its input; a later layer's is the one before's post-attention sum.
    const float* residual = embedded;
    if (l == 0) {
      bs::rms_norm_rows(kernels, residual, nullptr, layer.input_norm, normed, nullptr, tokens, width, eps);
    } else {
      bs::rms_norm_rows(kernels, down_out, post_summed, layer.input_norm, normed, summed, tokens, width, eps);
      residual = summed;
    }
    clock.lap(kNorms);
    apply(isa, layer.qkv, normed, tokens, qkv_out);
    clock.lap(kQkv);
    if (!plan.fuses_rope) {
      bs::rope_write_checked_kv(kernels, qkv_out, step_tokens, cos.data<float>(), sin.data<float>(), num_heads,
                                layer.caches, query);
    }
    clock.lap(kRopeWrite);
    bs::paged_attention(kernels, plan, query, layer.caches, requests, attended, plan.fuses_rope ? &decode_rope : nullptr);
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
      if (gate_up_out == nullptr) gate_up_out = buffer(owned, tokens, 2 * intermediate_size, place);
      apply(isa, gate_up, normed, tokens, gate_up_out);
      clock.lap(kGateUp);
      bs::silu_and_mul_rows(kernels, gate_up_out, activated, tokens, intermediate_size);
    }
    clock.lap(kSilu);
    apply(isa, layer.down, activated, tokens, down_out);
    clock.lap(kDown);
  }
  bs::rms_norm_rows(kernels, down_out, post_summed, stack->final_norm, out.data<float>(), summed, tokens, width, eps);
  clock.lap(kNorms);
  return {out, stage_seconds};
}

}  // namespace

PD_BUILD_OP(bs_decoder_stack_hold)
    .Inputs({"Embedding", "FinalNorm", paddle::Vec("InputNorms"), paddle::Vec("PostNorms"), paddle::Vec("QkvWeights"),
             paddle::Vec("OWeights"), paddle::Vec("GateUpWeights"), paddle::Vec("DownWeights"),
             paddle::Optional(paddle::Vec("QkvBiases")), paddle::Optional(paddle::Vec("OBiases")),
             paddle::Optional(paddle::Vec("GateUpBiases")), paddle::Optional(paddle::Vec("DownBiases")),
             paddle::Vec("KeyCaches"), paddle::Vec("ValueCaches")})
    .Outputs({"Handle"})
    .Attrs({"formats: std::vector<int>", "num_heads: int", "num_kv_heads: int", "intermediate_size: int64_t",
            "embedding_format: int", "vocab_size: int64_t"})
    .SetKernelFn(PD_KERNEL(HoldDecoderStack));

PD_BUILD_OP(bs_decoder_stack_release)
    .Inputs({"Handle"})
    .Outputs({"Released"})
    .SetKernelFn(PD_KERNEL(ReleaseDecoderStack));

PD_BUILD_OP(bs_decoder_stack)
    .Inputs({"Handle", "StepLayout", "Cos", "Sin"})
    .Outputs({"HiddenOut", "StageSeconds"})
    .Attrs({"eps: float", "query_tile: int", "isa: int", "time_stages: bool"})
    .SetKernelFn(PD_KERNEL(DecoderStack));
