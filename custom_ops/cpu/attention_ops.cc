// Paged attention over the block tables, and the rotary embedding + KV-cache write that feeds it.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "kernel_set.h"
#include "paddle/extension.h"

namespace {

void check_caches(const paddle::Tensor& key_cache, const paddle::Tensor& value_cache, int64_t num_kv_heads,
                  int64_t head_dim) {
  for (const paddle::Tensor* cache : {&key_cache, &value_cache}) {
    PD_CHECK(cache->is_cpu() && cache->shape().size() == 4 && cache->shape()[2] == num_kv_heads &&
                 cache->shape()[3] == head_dim,
             "a cache must be [num_blocks, block_size, num_kv_heads, head_dim]");
    PD_CHECK(cache->dtype() == paddle::DataType::FLOAT32 || cache->dtype() == paddle::DataType::BFLOAT16,
             "a cache must be float32 or bfloat16");
  }
  PD_CHECK(key_cache.dtype() == value_cache.dtype() && key_cache.shape() == value_cache.shape(),
           "the key and value caches must match");
}

template <class Cache>
Cache* cache_data(paddle::Tensor& cache) {
  return reinterpret_cast<Cache*>(cache.data());
}

template <class Cache>
void rope_write(const bs::KernelSet& kernels, const float* src, const int64_t* pos, const int64_t* slots,
                const float* cos_table, const float* sin_table, float* q_out, Cache* k_cache, Cache* v_cache,
                int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim, kv_width = num_kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (tokens * row >= bs::kParallelFloats)
  for (int64_t t = 0; t < tokens; ++t) {
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

// Rotates q and k of the fused qkv [tokens, (heads + 2 * kv_heads) * head_dim] by each token's
// position, stores k and v at the token's cache slot (rounded to bf16 in a bf16 cache), returns the
// rotated query [tokens, heads, head_dim].
std::vector<paddle::Tensor> RopeWriteKv(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                        const paddle::Tensor& cos, const paddle::Tensor& sin,
                                        const paddle::Tensor& slot_mapping, paddle::Tensor& key_cache,
                                        paddle::Tensor& value_cache, int num_heads, int num_kv_heads, int isa) {
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa).avx512);
  const int64_t tokens = qkv.shape()[0], head_dim = key_cache.shape()[3];
  check_caches(key_cache, value_cache, num_kv_heads, head_dim);
  PD_CHECK(qkv.shape()[1] == (num_heads + 2 * num_kv_heads) * head_dim, "qkv must be [tokens, (H + 2 KVH) * D]");
  PD_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens, "one position and slot per token");
  PD_CHECK(cos.shape()[1] == head_dim && sin.shape() == cos.shape(), "cos/sin must be [positions, head_dim]");
  const int64_t num_slots = key_cache.shape()[0] * key_cache.shape()[1], max_position = cos.shape()[0];
  const int64_t *pos = positions.data<int64_t>(), *slots = slot_mapping.data<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    PD_CHECK(pos[t] >= 0 && pos[t] < max_position, "position outside the rotary table");
    PD_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot outside the cache");
  }
  auto query = paddle::empty({tokens, num_heads, head_dim}, paddle::DataType::FLOAT32, qkv.place());
  const float *src = qkv.data<float>(), *cos_table = cos.data<float>(), *sin_table = sin.data<float>();
  if (key_cache.dtype() == paddle::DataType::FLOAT32) {
    rope_write(kernels, src, pos, slots, cos_table, sin_table, query.data<float>(), cache_data<float>(key_cache),
               cache_data<float>(value_cache), tokens, num_heads, num_kv_heads, head_dim);
  } else {
    rope_write(kernels, src, pos, slots, cos_table, sin_table, query.data<float>(), cache_data<bs::bf16>(key_cache),
               cache_data<bs::bf16>(value_cache), tokens, num_heads, num_kv_heads, head_dim);
  }
  return {query};
}

struct TileWork {
  int64_t request, first_query, num_queries, kv_head, num_kv_heads, cost;
};

template <class Cache>
void attend(void (*attend_tile)(const bs::AttentionTile<Cache>&), const std::vector<TileWork>& work,
            const float* q, const Cache* k, const Cache* v, const int64_t* starts, const int64_t* lens,
            const int64_t* table, int64_t width, float* o, int64_t scratch_floats, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t num_items = static_cast<int64_t>(work.size());
#pragma omp parallel if (num_items > 1)
  {
    std::vector<float> scratch(scratch_floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const TileWork& item = work[i];
      const int64_t num_queries = starts[item.request + 1] - starts[item.request];
      bs::AttentionTile<Cache> tile{q,
                                    k,
                                    v,
                                    table + item.request * width,
                                    o,
                                    scratch.data(),
                                    starts[item.request] + item.first_query,
                                    item.num_queries,
                                    lens[item.request] - num_queries + item.first_query,
                                    item.kv_head,
                                    item.num_kv_heads,
                                    num_heads,
                                    num_kv_heads,
                                    head_dim,
                                    block_size,
                                    scale};
      attend_tile(tile);
    }
  }
}

// Causal attention of every query over its request's cache blocks: request r's queries are
// query rows query_start[r]..query_start[r + 1], at the last positions of its context_lens[r] tokens.
std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& query, const paddle::Tensor& key_cache,
                                           const paddle::Tensor& value_cache, const paddle::Tensor& query_start,
                                           const paddle::Tensor& context_lens, const paddle::Tensor& block_table,
                                           int query_tile, int isa) {
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa).avx512);
  const int64_t tokens = query.shape()[0], num_heads = query.shape()[1], head_dim = query.shape()[2];
  const int64_t num_kv_heads = key_cache.shape()[2], block_size = key_cache.shape()[1];
  check_caches(key_cache, value_cache, num_kv_heads, head_dim);
  PD_CHECK(num_heads % num_kv_heads == 0 && head_dim % 16 == 0 && query_tile > 0, "unsupported attention shape");
  const int64_t num_requests = context_lens.numel(), width = block_table.shape()[1];
  PD_CHECK(query_start.numel() == num_requests + 1 && block_table.shape()[0] == num_requests, "one row per request");
  const int64_t *starts = query_start.data<int64_t>(), *lens = context_lens.data<int64_t>();
  const int64_t* table = block_table.data<int64_t>();
  const int64_t num_blocks = key_cache.shape()[0], group = num_heads / num_kv_heads;
  std::vector<TileWork> work;
  int64_t scratch_floats = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t num_queries = starts[r + 1] - starts[r];
    PD_CHECK(num_queries >= 0 && num_queries <= lens[r] && starts[r + 1] <= tokens, "bad query_start/context_lens");
    PD_CHECK((lens[r] + block_size - 1) / block_size <= width, "block table too narrow for the context");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b) {
      PD_CHECK(table[r * width + b] >= 0 && table[r * width + b] < num_blocks, "block id outside the cache");
    }
    for (int64_t first = 0; first < num_queries; first += query_tile) {
      const int64_t count = std::min<int64_t>(query_tile, num_queries - first);
      const int64_t cost = count * (lens[r] - num_queries + first + count);
      // A tile of few queries (a decode) takes several kv heads, up to the rows of a full query tile, so
      // that one thread reads each cache slot's heads together; a long one takes one kv head.
      const int64_t heads = std::clamp<int64_t>(query_tile / count, 1, bs::kMaxTileKvHeads);
      for (int64_t h = 0; h < num_kv_heads; h += heads) {
        const int64_t tile_heads = std::min(heads, num_kv_heads - h);
        work.push_back({r, first, count, h, tile_heads, cost * tile_heads});
        scratch_floats = std::max(scratch_floats, bs::attention_scratch_floats(count, tile_heads, group, head_dim));
      }
    }
  }
  // Longest tiles first, so the dynamic schedule ends evenly.
  std::stable_sort(work.begin(), work.end(), [](const TileWork& a, const TileWork& b) { return a.cost > b.cost; });
  auto out = paddle::empty({tokens, num_heads * head_dim}, paddle::DataType::FLOAT32, query.place());
  const float* q = query.data<float>();
  if (key_cache.dtype() == paddle::DataType::FLOAT32) {
    attend(kernels.attend_tile, work, q, key_cache.data<float>(), value_cache.data<float>(), starts, lens, table, width,
           out.data<float>(), scratch_floats, num_heads, num_kv_heads, head_dim, block_size);
  } else {
    attend(kernels.attend_tile_bf16, work, q, reinterpret_cast<const bs::bf16*>(key_cache.data()),
           reinterpret_cast<const bs::bf16*>(value_cache.data()), starts, lens, table, width, out.data<float>(),
           scratch_floats, num_heads, num_kv_heads, head_dim, block_size);
  }
  return {out};
}

}  // namespace

PD_BUILD_OP(bs_rope_write_kv)
    .Inputs({"Qkv", "Positions", "Cos", "Sin", "SlotMapping", "KeyCache", "ValueCache"})
    .Outputs({"Query", "KeyCacheOut", "ValueCacheOut"})
    .SetInplaceMap({{"KeyCache", "KeyCacheOut"}, {"ValueCache", "ValueCacheOut"}})
    .Attrs({"num_heads: int", "num_kv_heads: int", "isa: int"})
    .SetKernelFn(PD_KERNEL(RopeWriteKv));

PD_BUILD_OP(bs_paged_attention)
    .Inputs({"Query", "KeyCache", "ValueCache", "QueryStart", "ContextLens", "BlockTable"})
    .Outputs({"Out"})
    .Attrs({"query_tile: int", "isa: int"})
    .SetKernelFn(PD_KERNEL(PagedAttention));
