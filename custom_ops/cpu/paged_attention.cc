#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <omp.h>
#include <type_traits>
#include <vector>

namespace bs {
namespace {

template <class Cache>
void rope_write(const KernelSet& kernels, const float* src, const StepTokens& tokens, const float* cos_table,
                const float* sin_table, float* q_out, Cache* k_cache, Cache* v_cache, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim) {
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim, kv_width = num_kv_heads * head_dim;
  const int64_t *pos = tokens.positions, *slots = tokens.slots;
#pragma omp parallel for schedule(static) if (tokens.count * row >= kParallelFloats)
  for (int64_t t = 0; t < tokens.count; ++t) {
    const float* token = src + t * row;
    const float *c = cos_table + pos[t] * head_dim, *s = sin_table + pos[t] * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
      kernels.rotate_head(token + h * head_dim, c, s, q_out + (t * num_heads + h) * head_dim, head_dim);
    }
    const float* key = token + num_heads * head_dim;
    Cache* key_slot = k_cache + slots[t] * kv_width;
    Cache* value_slot = v_cache + slots[t] * kv_width;
    if constexpr (std::is_same_v<Cache, float>) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        kernels.rotate_head(key + h * head_dim, c, s, key_slot + h * head_dim, head_dim);
      }
      std::copy(key + kv_width, key + 2 * kv_width, value_slot);
    } else {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        kernels.rotate_head_bf16(key + h * head_dim, c, s, key_slot + h * head_dim, head_dim);
      }
      kernels.store_bf16(key + kv_width, value_slot, kv_width);
    }
  }
}

struct TileWork {
  int64_t request, first_query, num_queries, kv_head, num_kv_heads, cost;
};

template <class Cache>
AttentionTile<Cache> tile_of(const TileWork& item, const float* q, const KvCaches& caches,
                             const StepRequests& requests, int64_t num_heads, float* scratch, float* out) {
  const int64_t start = requests.query_start[item.request];
  const int64_t num_queries = requests.query_start[item.request + 1] - start;
  return {q,
          static_cast<const Cache*>(caches.key),
          static_cast<const Cache*>(caches.value),
          requests.block_table + item.request * requests.table_width,
          out,
          scratch,
          start + item.first_query,
          item.num_queries,
          requests.context_lens[item.request] - num_queries + item.first_query,
          item.kv_head,
          item.num_kv_heads,
          num_heads,
          caches.num_kv_heads,
          caches.head_dim,
          caches.block_size,
          1.0f / std::sqrt(static_cast<float>(caches.head_dim)),
          nullptr,
          false};
}

// Each thread takes the next tile of `work` one ahead of computing it (a shared counter: longest first,
// the threads end about together), so that its first span is asked for while the tile before computes.
template <class Cache>
void attend(void (*attend_tile)(const AttentionTile<Cache>&), const std::vector<TileWork>& work, const float* q,
            const KvCaches& caches, const StepRequests& requests, int64_t num_heads, int64_t scratch_floats,
            float* out) {
  const int64_t num_items = static_cast<int64_t>(work.size());
  std::atomic<int64_t> next_item{0};
#pragma omp parallel if (num_items > 1)
  {
    std::vector<float> scratch(scratch_floats);
    int64_t current = next_item.fetch_add(1);
    bool prefetched = false;
    while (current < num_items) {
      const int64_t following = next_item.fetch_add(1);
      AttentionTile<Cache> tile = tile_of<Cache>(work[current], q, caches, requests, num_heads, scratch.data(), out);
      AttentionTile<Cache> next_tile{};
      if (following < num_items) {
        next_tile = tile_of<Cache>(work[following], q, caches, requests, num_heads, scratch.data(), out);
        tile.next = &next_tile;
      }
      tile.first_span_prefetched = prefetched;
      attend_tile(tile);
      prefetched = true;
      current = following;
    }
  }
}

}  // namespace

KvCaches kv_caches(const paddle::Tensor& key_cache, const paddle::Tensor& value_cache) {
  for (const paddle::Tensor* cache : {&key_cache, &value_cache}) {
    PD_CHECK(cache->is_cpu() && cache->shape().size() == 4, "a cache must be [num_blocks, block_size, kv_heads, head_dim]");
    PD_CHECK(cache->dtype() == paddle::DataType::FLOAT32 || cache->dtype() == paddle::DataType::BFLOAT16,
             "a cache must be float32 or bfloat16");
  }
  PD_CHECK(key_cache.dtype() == value_cache.dtype() && key_cache.shape() == value_cache.shape(),
           "the key and value caches must match");
  const auto& shape = key_cache.shape();
  return {const_cast<void*>(key_cache.data()), const_cast<void*>(value_cache.data()), shape[0], shape[1], shape[2],
          shape[3], key_cache.dtype() == paddle::DataType::BFLOAT16};
}

void rope_write_kv(const KernelSet& kernels, const float* qkv, const StepTokens& tokens, const float* cos,
                   const float* sin, int64_t max_position, int64_t num_heads, KvCaches& caches, float* query) {
  const int64_t num_slots = caches.num_blocks * caches.block_size;
  for (int64_t t = 0; t < tokens.count; ++t) {
    PD_CHECK(tokens.positions[t] >= 0 && tokens.positions[t] < max_position, "position outside the rotary table");
    PD_CHECK(tokens.slots[t] >= 0 && tokens.slots[t] < num_slots, "slot outside the cache");
  }
  if (caches.bf16) {
    rope_write(kernels, qkv, tokens, cos, sin, query, static_cast<bf16*>(caches.key), static_cast<bf16*>(caches.value),
               num_heads, caches.num_kv_heads, caches.head_dim);
  } else {
    rope_write(kernels, qkv, tokens, cos, sin, query, static_cast<float*>(caches.key), static_cast<float*>(caches.value),
               num_heads, caches.num_kv_heads, caches.head_dim);
  }
}

void paged_attention(const KernelSet& kernels, const float* query, int64_t num_tokens, int64_t num_heads,
                     const KvCaches& caches, const StepRequests& requests, int query_tile, float* out) {
  const int64_t num_kv_heads = caches.num_kv_heads, head_dim = caches.head_dim, block_size = caches.block_size;
  PD_CHECK(num_heads % num_kv_heads == 0 && head_dim % 16 == 0 && query_tile > 0, "unsupported attention shape");
  const int64_t group = num_heads / num_kv_heads, width = requests.table_width;
  const int64_t *starts = requests.query_start, *lens = requests.context_lens, *table = requests.block_table;
  std::vector<TileWork> work;
  int64_t scratch_floats = 0;
  // Fewer requests than threads (a decode of one sequence): a tile per kv head, so that the threads share them.
  const bool few_requests = requests.count < omp_get_max_threads();
  for (int64_t r = 0; r < requests.count; ++r) {
    const int64_t num_queries = starts[r + 1] - starts[r];
    PD_CHECK(num_queries >= 0 && num_queries <= lens[r] && starts[r + 1] <= num_tokens, "bad query_start/context_lens");
    PD_CHECK((lens[r] + block_size - 1) / block_size <= width, "block table too narrow for the context");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b) {
      PD_CHECK(table[r * width + b] >= 0 && table[r * width + b] < caches.num_blocks, "block id outside the cache");
    }
    for (int64_t first = 0; first < num_queries; first += query_tile) {
      const int64_t count = std::min<int64_t>(query_tile, num_queries - first);
      const int64_t cost = count * (lens[r] - num_queries + first + count);
      // A tile of few queries (a decode) takes several kv heads, up to the rows of a full query tile, so
      // that one thread reads each cache slot's heads together; a long one takes one kv head.
      const int64_t heads = few_requests ? 1 : std::clamp<int64_t>(query_tile / count, 1, kMaxTileKvHeads);
      for (int64_t h = 0; h < num_kv_heads; h += heads) {
        const int64_t tile_heads = std::min(heads, num_kv_heads - h);
        work.push_back({r, first, count, h, tile_heads, cost * tile_heads});
        scratch_floats = std::max(scratch_floats, attention_scratch_floats(count, tile_heads, group, head_dim));
      }
    }
  }
  // Longest tiles first, so the dynamic schedule ends evenly.
  std::stable_sort(work.begin(), work.end(), [](const TileWork& a, const TileWork& b) { return a.cost > b.cost; });
  if (caches.bf16) {
    attend(kernels.attend_tile_bf16, work, query, caches, requests, num_heads, scratch_floats, out);
  } else {
    attend(kernels.attend_tile, work, query, caches, requests, num_heads, scratch_floats, out);
  }
}

}  // namespace bs
