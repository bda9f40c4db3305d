// Paddle op over the step-input kernels (GPU only): a step's flat inputs from its compact delta
// (worker/inputs/step_delta.py), the device block tables updated in place.
#include <vector>

#include "paddle_glue.h"
#include "step_input_kernels.cuh"

namespace {

using namespace bs::gpu;

std::vector<paddle::Tensor> PrepareStepInputs(const paddle::Tensor& delta, paddle::Tensor& block_tables,
                                              const paddle::Tensor& last_sampled, int64_t num_requests,
                                              int64_t num_tokens, int64_t table_width, int64_t block_size) {
  glue::check_indices(delta, "delta");
  glue::check_indices(block_tables, "block_tables");
  glue::check_indices(last_sampled, "last_sampled");
  PD_CHECK(block_tables.shape().size() == 2 && last_sampled.numel() == block_tables.shape()[0],
           "block_tables [slots, max blocks] and last_sampled [slots]");
  PD_CHECK(num_requests > 0 && num_tokens >= num_requests && table_width > 0 && block_size > 0 &&
               delta.numel() >= num_requests * kStepRecordFields && table_width <= block_tables.shape()[1],
           "bs_prepare_step_inputs: inconsistent sizes");
  const auto place = delta.place();
  auto tokens = [&] { return paddle::empty({num_tokens}, paddle::DataType::INT64, place); };
  auto input_ids = tokens(), positions = tokens(), slot_mapping = tokens();
  auto query_start = paddle::empty({num_requests + 1}, paddle::DataType::INT64, place);
  auto context_lens = paddle::empty({num_requests}, paddle::DataType::INT64, place);
  auto block_table = paddle::empty({num_requests, table_width}, paddle::DataType::INT64, place);
  const StepInputParams p{delta.data<int64_t>(),
                          num_requests,
                          num_tokens,
                          block_tables.data<int64_t>(),
                          block_tables.shape()[1],
                          block_tables.shape()[0],
                          last_sampled.data<int64_t>(),
                          block_size,
                          table_width,
                          input_ids.data<int64_t>(),
                          positions.data<int64_t>(),
                          slot_mapping.data<int64_t>(),
                          query_start.data<int64_t>(),
                          context_lens.data<int64_t>(),
                          block_table.data<int64_t>()};
  glue::check_launched(launch_prepare_step_inputs(p, delta.stream()), "bs_prepare_step_inputs");
  return {input_ids, positions, slot_mapping, query_start, context_lens, block_table};
}

}  // namespace

PD_BUILD_OP(bs_prepare_step_inputs)
    .Inputs({"Delta", "BlockTables", "LastSampled"})
    .Outputs({"InputIds", "Positions", "SlotMapping", "QueryStart", "ContextLens", "BlockTable", "BlockTablesOut"})
    .SetInplaceMap({{"BlockTables", "BlockTablesOut"}})
    .Attrs({"num_requests: int64_t", "num_tokens: int64_t", "table_width: int64_t", "block_size: int64_t"})
    .SetKernelFn(PD_KERNEL(PrepareStepInputs));
