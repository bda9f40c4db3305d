// Rotary embedding fused into the KV-cache write: each token's query and key heads are rotated by
// its position (Hugging Face's half-split layout), the key and value go to the token's cache slot,
// the rotated query is returned. One block per token. A cache of the activations' type T gets the
// rotated key rounded to T; an 8-bit cache (kv_rows.cuh) gets each key and value row encoded with
// its scale, a warp a row.
#pragma once

#include "kv_rows.cuh"

namespace bs::gpu {

constexpr int kRopeThreads = 128;

template <class T, class Cache = T>
struct RopeWriteKvParams {
  using Element = T;
  using CacheElement = Cache;
  const T* qkv;                  // [tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q | k | v
  const int64_t* positions;      // [tokens]
  const float* cos;              // [max_position, head_dim], both halves equal
  const float* sin;              // [max_position, head_dim]
  const int64_t* slot_mapping;   // [tokens] block_id * block_size + position % block_size
  Cache* key_cache;              // [num_slots, num_kv_heads, kv_row_elements<Cache>(head_dim)]: blocks x block_size
  Cache* value_cache;            // same
  T* query;                      // [tokens, num_heads, head_dim] out
  int64_t tokens, num_slots, max_position;
  int num_heads, num_kv_heads, head_dim;
};

// Element i of a key head x rotated, each product and sum rounded once (an 8-bit row's codes depend on its bits).
template <class T>
BS_DEVICE float rotated_element(const T* x, const float* cos, const float* sin, int i, int half) {
  if (i < half) return __fsub_rn(__fmul_rn(to_float(x[i]), cos[i]), __fmul_rn(to_float(x[half + i]), sin[i]));
  const int j = i - half;
  return __fadd_rn(__fmul_rn(to_float(x[i]), cos[j]), __fmul_rn(to_float(x[j]), sin[j]));
}

// The token's key (rotated) and value rows into 8-bit caches at `slot`: warp w writes rows w, w + 4, ... of the
// key heads then the value heads. Reached by the whole block.
template <class P>
BS_DEVICE void write_scaled_kv(const P& p, const typename P::Element* row, const float* cos, const float* sin,
                               int64_t slot) {
  using Cache = typename P::CacheElement;
  const int dim = p.head_dim, half = dim / 2, rows = 2 * p.num_kv_heads;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  for (int first_row = 0; first_row < rows; first_row += warps) {
    const int r = first_row + warp_id();
    const bool is_key = r < p.num_kv_heads;
    const typename P::Element* x = row + static_cast<int64_t>(p.num_heads + r) * dim;  // k heads, then v heads
    Cache* cache = is_key ? p.key_cache : p.value_cache;
    Cache* out = cache + (slot * p.num_kv_heads + r % p.num_kv_heads) * kv_row_elements<Cache>(dim);
    store_scaled_row(out, dim, r < rows,
                     [&](int i) { return is_key ? rotated_element(x, cos, sin, i, half) : to_float(x[i]); });
  }
}

// A token whose position or slot is out of range (the host checks both before the step) writes
// no cache entry and gets a zero query rather than reading or writing out of bounds.
template <class P>
__global__ void __launch_bounds__(kRopeThreads) rope_write_kv_kernel(const P p) {
  using T = typename P::Element;
  using Cache = typename P::CacheElement;
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
  // Heads 0..num_heads are the query's, the next num_kv_heads the key's (a cache of T; an 8-bit cache's
  // rows are written whole below): one pair (i, i + half) each.
  const int rotated_heads = p.num_heads + (KvRow<Cache>::kScaled ? 0 : p.num_kv_heads);
  for (int pair = threadIdx.x; pair < rotated_heads * half; pair += blockDim.x) {
    const int head = pair / half, i = pair % half;
    const float x1 = to_float(row[head * dim + i]), x2 = to_float(row[head * dim + half + i]);
    const float c = cos[i], s = sin[i];
    T* target = query + head * dim;
    if constexpr (!KvRow<Cache>::kScaled) {
      if (head >= p.num_heads) target = p.key_cache + slot * kv_width + (head - p.num_heads) * dim;
    }
    target[i] = from_float<T>(x1 * c - x2 * s);
    target[half + i] = from_float<T>(x2 * c + x1 * s);
  }
  if constexpr (KvRow<Cache>::kScaled) {
    write_scaled_kv(p, row, cos, sin, slot);
  } else {
    const T* value = row + static_cast<int64_t>(p.num_heads + p.num_kv_heads) * dim;
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) p.value_cache[slot * kv_width + i] = value[i];
  }
}

template <class P>
Status launch_rope_write_kv(const P& p, Stream stream) {
  if (p.tokens < 0 || p.head_dim <= 0 || p.head_dim % 2 != 0 || p.num_heads <= 0 || p.num_kv_heads <= 0) {
    return kInvalidArgument;
  }
  if (p.tokens == 0) return kSuccess;
  BS_LAUNCH(rope_write_kv_kernel<P>, dim3(static_cast<unsigned>(p.tokens)), dim3(kRopeThreads), 0, stream, p);
  return launch_status();
}

}  // namespace bs::gpu
