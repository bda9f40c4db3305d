// A step's flat inputs built on the device from its compact delta, as FastDeploy's
// get_padding_offset and update_inputs_v1 do: the block tables of the running requests stay on the
// device (one row per batch slot) and the host sends, per scheduled request, one record, its new
// block ids and the tokens it knows; a token the step before sampled comes from that step's
// `last_sampled` entry of the slot, which never left the device.
//
// Output: input ids, positions, slot mapping, query start, context lengths and the block table of
// the scheduled requests, exactly what worker/inputs/step_inputs.py's build_step_inputs makes on the host.
#pragma once

#include "numeric.cuh"

namespace bs::gpu {

// One scheduled request's record in the step delta (int64 fields). Offsets point into the delta itself.
enum StepRecordField : int {
  kSlot = 0,          // its row in the device block tables and last_sampled
  kNumComputed,       // tokens already in the cache: the first query's position
  kNumScheduled,      // tokens computed in this step
  kQueryStart,        // flat index of its first token in this step
  kNumBlocksBefore,   // blocks its table row already holds
  kNumNewBlocks,      // blocks appended by this step
  kNewBlocksOffset,   // where they are in the delta
  kNumKnownTokens,    // leading tokens of the step the host sends; the rest come from last_sampled
  kKnownTokensOffset,  // where they are in the delta
  kStepRecordFields
};

constexpr int kStepInputThreads = 256;
constexpr int kBlockDeltaThreads = 32;  // a step appends a block or two per request

struct StepInputParams {
  const int64_t* delta;   // [num_requests * kStepRecordFields records | new block ids | known tokens]
  int64_t num_requests, num_tokens;
  int64_t* block_tables;  // [num_slots, table_stride], updated in place
  int64_t table_stride, num_slots;
  const int64_t* last_sampled;  // [num_slots] the token each slot's request sampled last
  int64_t block_size;
  int64_t table_width;  // columns of the step's block table (its widest row)
  int64_t* input_ids;     // [num_tokens]
  int64_t* positions;     // [num_tokens]
  int64_t* slot_mapping;  // [num_tokens]
  int64_t* query_start;   // [num_requests + 1]
  int64_t* context_lens;  // [num_requests]
  int64_t* block_table;   // [num_requests, table_width], padded with block 0
};

BS_DEVICE const int64_t* step_record(const StepInputParams& p, int64_t request) {
  return p.delta + request * kStepRecordFields;
}

// One block per request: appends its new blocks to its slot's table row, writes its query start and length.
__global__ void __launch_bounds__(kBlockDeltaThreads) apply_block_deltas_kernel(const StepInputParams p) {
  const int64_t request = blockIdx.x;
  const int64_t* record = step_record(p, request);
  int64_t* row = p.block_tables + record[kSlot] * p.table_stride + record[kNumBlocksBefore];
  const int64_t* new_blocks = p.delta + record[kNewBlocksOffset];
  for (int64_t i = threadIdx.x; i < record[kNumNewBlocks]; i += blockDim.x) row[i] = new_blocks[i];
  if (threadIdx.x == 0) {
    p.query_start[request] = record[kQueryStart];
    p.context_lens[request] = record[kNumComputed] + record[kNumScheduled];
    if (request == p.num_requests - 1) p.query_start[p.num_requests] = p.num_tokens;
  }
}

// The request holding flat token `token`: the largest r whose record's query start is <= token.
BS_DEVICE int64_t request_of_step_token(const StepInputParams& p, int64_t token) {
  int64_t low = 0, high = p.num_requests - 1;
  while (low < high) {
    const int64_t middle = (low + high + 1) / 2;
    if (step_record(p, middle)[kQueryStart] <= token) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  return low;
}

// One thread per token (ids, position, slot), then one per entry of the step's block table.
__global__ void __launch_bounds__(kStepInputThreads) build_step_inputs_kernel(const StepInputParams p) {
  const int64_t count = p.num_tokens + p.num_requests * p.table_width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < count; index += stride) {
    if (index < p.num_tokens) {
      const int64_t* record = step_record(p, request_of_step_token(p, index));
      const int64_t local = index - record[kQueryStart], position = record[kNumComputed] + local;
      const int64_t* row = p.block_tables + record[kSlot] * p.table_stride;
      p.positions[index] = position;
      p.slot_mapping[index] = row[position / p.block_size] * p.block_size + position % p.block_size;
      p.input_ids[index] =
          local < record[kNumKnownTokens] ? p.delta[record[kKnownTokensOffset] + local] : p.last_sampled[record[kSlot]];
    } else {
      const int64_t entry = index - p.num_tokens, request = entry / p.table_width, column = entry % p.table_width;
      const int64_t* record = step_record(p, request);
      const int64_t held = record[kNumBlocksBefore] + record[kNumNewBlocks];
      p.block_table[entry] = column < held ? p.block_tables[record[kSlot] * p.table_stride + column] : 0;
    }
  }
}

// The host built the delta from the worker's own state and checked it (slots, table room, blocks
// for every token); the kernels trust it.
inline Status launch_prepare_step_inputs(const StepInputParams& p, Stream stream) {
  if (p.num_requests <= 0 || p.num_tokens < p.num_requests || p.table_width <= 0 || p.block_size <= 0) {
    return kInvalidArgument;
  }
  BS_LAUNCH(apply_block_deltas_kernel, dim3(static_cast<unsigned>(p.num_requests)), dim3(kBlockDeltaThreads), 0,
            stream, p);
  const Status status = launch_status();
  if (status != kSuccess) return status;
  const int64_t count = p.num_tokens + p.num_requests * p.table_width;
  const int64_t blocks = min_i64((count + kStepInputThreads - 1) / kStepInputThreads, 1 << 16);
  BS_LAUNCH(build_step_inputs_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kStepInputThreads), 0, stream, p);
  return launch_status();
}

}  // namespace bs::gpu
