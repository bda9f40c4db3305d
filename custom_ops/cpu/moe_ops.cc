// A mixture of experts' MLP over packed experts (bs_moe_experts): out[t] = sum over token t's chosen experts e of
// weight * down_e(silu(gate_e(x[t])) * up_e(x[t])). The choices are grouped by expert (a counting sort), so that
// each chosen expert's weights stream once per call through the packed GEMM (linear_gemm.h) over all its tokens:
// gate|up, with SiLU-and-multiply fused where the micro-kernel has it, then down. The rows are gathered into expert
// order before and summed back per token after, each in one parallel pass: every output row is written by one thread,
// in the order of the token's choices.
// Where the step chose many experts for its threads (a decode step's: a few rows each), the threads take whole
// experts, each expert's GEMMs on one thread: one parallel region for the layer instead of two or three per
// expert, whose barriers cost more than such GEMMs. Otherwise (few experts, many rows each: a prefill of a model
// with few experts) the experts run one after another, each GEMM parallel over its panels.
#include <omp.h>

#include <vector>

#include "cpu_isa.h"
#include "kernel_set.h"
#include "linear_gemm.h"
#include "paddle/extension.h"
#include "row_ops.h"
#include "weight_pack.h"

namespace {

using bs::linear::Format;

// The threads take whole experts where the step chose at least this many per thread (dynamic scheduling evens
// out their rows); below it, an expert's GEMM parallel over its panels balances better.
constexpr int64_t kExpertsPerThread = 4;

Format format_of(int id) {
  PD_CHECK(bs::linear::is_format(id), "unknown weight format ", id);
  return static_cast<Format>(id);
}

// The stacked packed weights of `num_experts` experts, each from a [k, n] weight; returns one expert's bytes.
int64_t check_stacked(const paddle::Tensor& packed, Format format, int64_t num_experts, int64_t k, int64_t n,
                      const char* name) {
  const int64_t panels = bs::linear::num_panels(n), bytes = bs::linear::panel_bytes(format, k);
  PD_CHECK(packed.is_cpu() && packed.dtype() == paddle::DataType::UINT8 && packed.shape().size() == 2 &&
               packed.shape()[0] == num_experts * panels && packed.shape()[1] == bytes,
           name, " must stack ", num_experts, " experts' weights of [", k, ", ", n, "] packed in their format");
  return panels * bytes;
}

// Where each choice goes in expert order: the choices of expert e are rows starts[e] .. starts[e + 1] of the
// gathered buffers, in token order; row_of[t * top_k + j] is the row of token t's j-th choice.
struct Grouping {
  std::vector<int64_t> starts, row_of, token_of_row;
};

Grouping group_by_expert(const int64_t* expert_ids, int64_t tokens, int64_t top_k, int64_t num_experts) {
  const int64_t choices = tokens * top_k;
  Grouping grouping{std::vector<int64_t>(num_experts + 1, 0), std::vector<int64_t>(choices),
                    std::vector<int64_t>(choices)};
  for (int64_t c = 0; c < choices; ++c) {
    PD_CHECK(expert_ids[c] >= 0 && expert_ids[c] < num_experts, "expert id ", expert_ids[c], " outside [0, ",
             num_experts, ")");
    ++grouping.starts[expert_ids[c] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) grouping.starts[e + 1] += grouping.starts[e];
  std::vector<int64_t> next(grouping.starts.begin(), grouping.starts.end() - 1);
  for (int64_t c = 0; c < choices; ++c) {
    const int64_t row = next[expert_ids[c]]++;
    grouping.row_of[c] = row;
    grouping.token_of_row[row] = c / top_k;
  }
  return grouping;
}

std::vector<paddle::Tensor> MoeExperts(const paddle::Tensor& x, const paddle::Tensor& expert_ids,
                                       const paddle::Tensor& weights, const paddle::Tensor& gate_up,
                                       const paddle::Tensor& down, int64_t num_experts, int64_t intermediate_size,
                                       int gate_up_format_id, int down_format_id, int isa) {
  const bs::Isa resolved = bs::resolve_isa(isa);
  PD_CHECK(x.is_cpu() && x.dtype() == paddle::DataType::FLOAT32 && x.shape().size() == 2,
           "x must be a 2-d float32 CPU tensor");
  const int64_t tokens = x.shape()[0], hidden = x.shape()[1];
  PD_CHECK(expert_ids.dtype() == paddle::DataType::INT64 && expert_ids.shape().size() == 2 &&
               expert_ids.shape()[0] == tokens,
           "expert_ids must be int64 [tokens, top_k]");
  const int64_t top_k = expert_ids.shape()[1];
  PD_CHECK(weights.dtype() == paddle::DataType::FLOAT32 && weights.shape() == expert_ids.shape(),
           "weights must be float32 [tokens, top_k]");
  const Format gate_up_format = format_of(gate_up_format_id), down_format = format_of(down_format_id);
  const int64_t gate_up_bytes =
      check_stacked(gate_up, gate_up_format, num_experts, hidden, 2 * intermediate_size, "gate_up");
  const int64_t down_bytes = check_stacked(down, down_format, num_experts, intermediate_size, hidden, "down");

  const Grouping grouping = group_by_expert(expert_ids.data<int64_t>(), tokens, top_k, num_experts);
  const int64_t rows = tokens * top_k;
  std::vector<float> gathered(rows * hidden), activated(rows * intermediate_size), expert_out(rows * hidden);
  const float* x_data = x.data<float>();
#pragma omp parallel for schedule(static) if (rows * hidden >= bs::kParallelFloats)
  for (int64_t row = 0; row < rows; ++row) {
    __builtin_memcpy(&gathered[row * hidden], x_data + grouping.token_of_row[row] * hidden, hidden * sizeof(float));
  }

  const bs::KernelSet& kernels = bs::kernels_for(resolved);
  std::vector<int64_t> chosen;  // the experts with rows
  for (int64_t e = 0; e < num_experts; ++e) {
    if (grouping.starts[e + 1] > grouping.starts[e]) chosen.push_back(e);
  }
  const int64_t num_chosen = static_cast<int64_t>(chosen.size());
  const bool experts_in_parallel = num_chosen >= kExpertsPerThread * omp_get_max_threads();
#pragma omp parallel if (experts_in_parallel)
  {
    std::vector<float> gate_up_out;  // where the GEMM cannot fuse SiLU-and-multiply
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < num_chosen; ++i) {
      const int64_t e = chosen[i], first = grouping.starts[e], count = grouping.starts[e + 1] - first;
      const uint8_t* expert_gate_up = gate_up.data<uint8_t>() + e * gate_up_bytes;
      float* expert_activated = &activated[first * intermediate_size];
      if (!bs::linear::gemm_silu_and_mul(resolved, gate_up_format, &gathered[first * hidden], count, hidden,
                                         expert_gate_up, 2 * intermediate_size, nullptr, expert_activated)) {
        if (static_cast<int64_t>(gate_up_out.size()) < count * 2 * intermediate_size) {
          gate_up_out.resize(count * 2 * intermediate_size);
        }
        bs::linear::gemm(resolved, gate_up_format, &gathered[first * hidden], count, hidden, expert_gate_up,
                         2 * intermediate_size, nullptr, gate_up_out.data());
        bs::silu_and_mul_rows(kernels, gate_up_out.data(), expert_activated, count, intermediate_size);
      }
      bs::linear::gemm(resolved, down_format, expert_activated, count, intermediate_size,
                       down.data<uint8_t>() + e * down_bytes, hidden, nullptr, &expert_out[first * hidden]);
    }
  }

  auto out = paddle::empty({tokens, hidden}, paddle::DataType::FLOAT32, x.place());
  float* out_data = out.data<float>();
  const float* weight_data = weights.data<float>();
#pragma omp parallel for schedule(static) if (rows * hidden >= bs::kParallelFloats)
  for (int64_t t = 0; t < tokens; ++t) {
    float* token_out = out_data + t * hidden;
    for (int64_t i = 0; i < hidden; ++i) token_out[i] = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      const float weight = weight_data[t * top_k + j];
      const float* from = &expert_out[grouping.row_of[t * top_k + j] * hidden];
      for (int64_t i = 0; i < hidden; ++i) token_out[i] += weight * from[i];
    }
  }
  return {out};
}

}  // namespace

PD_BUILD_OP(bs_moe_experts)
    .Inputs({"X", "ExpertIds", "Weights", "GateUp", "Down"})
    .Outputs({"Out"})
    .Attrs({"num_experts: int64_t", "intermediate_size: int64_t", "gate_up_format: int", "down_format: int",
            "isa: int"})
    .SetKernelFn(PD_KERNEL(MoeExperts));
