// Paged attention over the block tables, and the rotary embedding + KV-cache write that feeds it.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_isa.h"
#include "kernel_set.h"
#include "paddle/extension.h"

namespace {

const bs::KernelSet& kernels_for(bool avx512) {
  bs::require_avx2_fma();
  return bs::use_avx512(avx512) ? bs::avx512_kernels() : bs::avx2_kernels();
}

void check_cache(const paddle::Tensor& cache, int64_t num_kv_heads, int64_t head_dim) {
  PD_CHECK(cache.is_cpu() && cache.dtype() == paddle::DataType::FLOAT32 && cache.shape().size() == 4 &&
               cache.shape()[2] == num_kv_heads && cache.shape()[3] == head_dim,
           "a cache must be float32 [num_blocks, block_size, num_kv_heads, head_dim]");
}

// Rotates q and k of the fused qkv [tokens, (heads + 2 * kv_heads) * head_dim] by each token's
// position, stores k and v at the token's cache slot, returns the rotated query [tokens, heads, head_dim].
std::vector<paddle::Tensor> RopeWriteKv(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                        const paddle::Tensor& cos, const paddle::Tensor& sin,
                                        const paddle::Tensor& slot_mapping, paddle::Tensor& key_cache,
                                        paddle::Tensor& value_cache, int num_heads, int num_kv_heads, bool avx512) {
  const auto& kernels = kernels_for(avx512);
  const int64_t tokens = qkv.shape()[0], head_dim = key_cache.shape()[3];
  check_cache(key_cache, num_kv_heads, head_dim);
  check_cache(value_cache, num_kv_heads, head_dim);
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
  float *q_out = query.data<float>(), *k_cache = key_cache.data<float>(), *v_cache = value_cache.data<float>();
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim, kv_width = num_kv_heads * head_dim;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* token = src + t * row;
    const float *c = cos_table + pos[t] * head_dim, *s = sin_table + pos[t] * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
      kernels.rotate_head(token + h * head_dim, c, s, q_out + (t * num_heads + h) * head_dim, head_dim);
    }
    const float* key = token + num_heads * head_dim;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      kernels.rotate_head(key + h * head_dim, c, s, k_cache + slots[t] * kv_width + h * head_dim, head_dim);
    }
    std::copy(key + kv_width, key + 2 * kv_width, v_cache + slots[t] * kv_width);
  }
  return {query};
}

struct TileWork {
  int64_t request, first_query, num_queries, kv_head, cost;
};

// Causal attention of every query over its request's cache blocks: request r's queries are
// query rows query_start[r]..query_start[r + 1], at the last positions of its context_lens[r] tokens.
std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& query, const paddle::Tensor& key_cache,
                                           const paddle::Tensor& value_cache, const paddle::Tensor& query_start,
                                           const paddle::Tensor& context_lens, const paddle::Tensor& block_table,
                                           int query_tile, bool avx512) {
  const auto& kernels = kernels_for(avx512);
  const int64_t tokens = query.shape()[0], num_heads = query.shape()[1], head_dim = query.shape()[2];
  const int64_t num_kv_heads = key_cache.shape()[2], block_size = key_cache.shape()[1];
  check_cache(key_cache, num_kv_heads, head_dim);
  check_cache(value_cache, num_kv_heads, head_dim);
  PD_CHECK(num_heads % num_kv_heads == 0 && head_dim % 16 == 0 && query_tile > 0, "unsupported attention shape");
  const int64_t num_requests = context_lens.numel(), width = block_table.shape()[1];
  PD_CHECK(query_start.numel() == num_requests + 1 && block_table.shape()[0] == num_requests, "one row per request");
  const int64_t *starts = query_start.data<int64_t>(), *lens = context_lens.data<int64_t>();
  const int64_t* table = block_table.data<int64_t>();
  const int64_t num_blocks = key_cache.shape()[0];
  std::vector<TileWork> work;
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
      for (int64_t h = 0; h < num_kv_heads; ++h) work.push_back({r, first, count, h, cost});
    }
  }
  // Longest tiles first, so the dynamic schedule ends evenly.
  std::stable_sort(work.begin(), work.end(), [](const TileWork& a, const TileWork& b) { return a.cost > b.cost; });
  auto out = paddle::empty({tokens, num_heads * head_dim}, paddle::DataType::FLOAT32, query.place());
  const int64_t group = num_heads / num_kv_heads;
  const int64_t scratch_floats = bs::attention_scratch_floats(query_tile, group, head_dim);
  const float *q = query.data<float>(), *k = key_cache.data<float>(), *v = value_cache.data<float>();
  float* o = out.data<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t num_items = static_cast<int64_t>(work.size());
#pragma omp parallel
  {
    std::vector<float> scratch(scratch_floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const TileWork& item = work[i];
      const int64_t num_queries = starts[item.request + 1] - starts[item.request];
      bs::AttentionTile tile{q,
                             k,
                             v,
                             table + item.request * width,
                             o,
                             scratch.data(),
                             starts[item.request] + item.first_query,
                             item.num_queries,
                             lens[item.request] - num_queries + item.first_query,
                             item.kv_head,
                             num_heads,
                             num_kv_heads,
                             head_dim,
                             block_size,
                             scale};
      kernels.attend_tile(tile);
    }
  }
  return {out};
}

}  // namespace

PD_BUILD_OP(bs_rope_write_kv)
    .Inputs({"Qkv", "Positions", "Cos", "Sin", "SlotMapping", "KeyCache", "ValueCache"})
    .Outputs({"Query", "KeyCacheOut", "ValueCacheOut"})
    .SetInplaceMap({{"KeyCache", "KeyCacheOut"}, {"ValueCache", "ValueCacheOut"}})
    .Attrs({"num_heads: int", "num_kv_heads: int", "avx512: bool"})
    .SetKernelFn(PD_KERNEL(RopeWriteKv));

PD_BUILD_OP(bs_paged_attention)
    .Inputs({"Query", "KeyCache", "ValueCache", "QueryStart", "ContextLens", "BlockTable"})
    .Outputs({"Out"})
    .Attrs({"query_tile: int", "avx512: bool"})
    .SetKernelFn(PD_KERNEL(PagedAttention));
