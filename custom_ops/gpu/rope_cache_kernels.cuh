// Rotary embedding fused into the KV-cache write: each token's query and key heads are rotated by
// its position (Hugging Face's half-split layout), the key and value go to the token's cache slot,
// the rotated query is returned. One block per token.
#pragma once

#include "numeric.cuh"

namespace bs::gpu {

constexpr int kRopeThreads = 128;

template <class T>
struct RopeWriteKvParams {
  const T* qkv;                  // [tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q | k | v
  const int64_t* positions;      // [tokens]
  const float* cos;              // [max_position, head_dim], both halves equal
  const float* sin;              // [max_position, head_dim]
  const int64_t* slot_mapping;   // [tokens] block_id * block_size + position % block_size
  T* key_cache;                  // [num_slots, num_kv_heads, head_dim] (blocks x block_size slots)
  T* value_cache;                // same
  T* query;                      // [tokens, num_heads, head_dim] out
  int64_t tokens, num_slots, max_position;
  int num_heads, num_kv_heads, head_dim;
};

// A token whose position or slot is out of range (the host checks both before the step) writes
// no cache entry and gets a zero query rather than reading or writing out of bounds.
template <class T>
__global__ void __launch_bounds__(kRopeThreads) rope_write_kv_kernel(const RopeWriteKvParams<T> p) {
  const int64_t token = blockIdx.x;
  const int64_t position = p.positions[token], slot = p.slot_mapping[token];
  const int dim = p.head_dim, half = dim / 2;
  const int64_t row_width = static_cast<int64_t>(p.num_heads + 2 * p.num_kv_heads) * dim;
  const T* row = p.qkv + token * row_width;
  T* query = p.query + token * p.num_heads * dim;
  if (position < 0 || position >= p.max_position || slot < 0 || slot >= p.num_slots) {
    for (int i = threadIdx.x; i < p.num_heads * dim; i += blockDim.x) query[i] = from_float<T>(0.0f);
    return;
  }
  const float* cos = p.cos + position * dim;
  const float* sin = p.sin + position * dim;
  const int64_t kv_width = static_cast<int64_t>(p.num_kv_heads) * dim;
  // Heads 0..num_heads are the query's, the next num_kv_heads the key's: one pair (i, i + half) each.
  for (int pair = threadIdx.x; pair < (p.num_heads + p.num_kv_heads) * half; pair += blockDim.x) {
    const int head = pair / half, i = pair % half;
    const float x1 = to_float(row[head * dim + i]), x2 = to_float(row[head * dim + half + i]);
    const float c = cos[i], s = sin[i];
    T* target = head < p.num_heads ? query + head * dim : p.key_cache + slot * kv_width + (head - p.num_heads) * dim;
    target[i] = from_float<T>(x1 * c - x2 * s);
    target[half + i] = from_float<T>(x2 * c + x1 * s);
  }
  const T* value = row + static_cast<int64_t>(p.num_heads + p.num_kv_heads) * dim;
  for (int i = threadIdx.x; i < kv_width; i += blockDim.x) p.value_cache[slot * kv_width + i] = value[i];
}

template <class T>
Status launch_rope_write_kv(const RopeWriteKvParams<T>& p, Stream stream) {
  if (p.tokens < 0 || p.head_dim <= 0 || p.head_dim % 2 != 0 || p.num_heads <= 0 || p.num_kv_heads <= 0) {
    return kInvalidArgument;
  }
  if (p.tokens == 0) return kSuccess;
  BS_LAUNCH(rope_write_kv_kernel<T>, dim3(static_cast<unsigned>(p.tokens)), dim3(kRopeThreads), 0, stream, p);
  return launch_status();
}

}  // namespace bs::gpu
