// Paddle ops over the attention kernels: rotary embedding + KV-cache write, and paged attention.
// Same names, inputs and attributes as the CPU ops (custom_ops/cpu/attention_ops.cc); the tensors
// are the model's dtype (float32, bfloat16 or float16) instead of float32 only, and the caches that
// dtype or 8-bit rows (kv_rows.cuh) as the CPU ops take them: int8 tensors of int8 codes, uint8
// tensors of fp8 e4m3 codes, [num_blocks, block_size, num_kv_heads, head_dim + 2].
#include <cmath>
#include <vector>

#include "attention_kernels.cuh"
#include "paddle_glue.h"
#include "rope_cache_kernels.cuh"

namespace {

using namespace bs::gpu;

// The caches' dtype code (numeric.cuh's Dtype) and head_dim, checked.
struct CacheFormat {
  Dtype dtype;
  int64_t head_dim;
};

CacheFormat check_caches(const paddle::Tensor& key_cache, const paddle::Tensor& value_cache,
                         const paddle::Tensor& like) {
  for (const paddle::Tensor* cache : {&key_cache, &value_cache}) {
    glue::check_on_gpu(*cache, "a cache");
    PD_CHECK(cache->shape().size() == 4, "a cache must be [num_blocks, block_size, num_kv_heads, row]");
  }
  PD_CHECK(key_cache.shape() == value_cache.shape() && key_cache.dtype() == value_cache.dtype(),
           "the key and value caches must match");
  const int64_t row = key_cache.shape()[3];
  switch (key_cache.dtype()) {
    case paddle::DataType::INT8:
      return {Dtype::kInt8, row - KvRow<Int8Code>::kScaleElements};
    case paddle::DataType::UINT8:
      return {Dtype::kFp8E4M3, row - KvRow<Fp8E4M3Code>::kScaleElements};
    default:
      PD_CHECK(key_cache.dtype() == like.dtype(), "the caches must have the activations' dtype, or be int8 or uint8");
      return {glue::dtype_of(like), row};
  }
}

std::vector<paddle::Tensor> RopeWriteKv(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                        const paddle::Tensor& cos, const paddle::Tensor& sin,
                                        const paddle::Tensor& slot_mapping, paddle::Tensor& key_cache,
                                        paddle::Tensor& value_cache, int num_heads, int num_kv_heads, IsaAttr) {
  glue::check_on_gpu(qkv, "qkv");
  const CacheFormat cache = check_caches(key_cache, value_cache, qkv);
  glue::check_indices(positions, "positions");
  glue::check_indices(slot_mapping, "slot_mapping");
  const int64_t tokens = qkv.shape()[0], head_dim = cache.head_dim;
  PD_CHECK(head_dim > 0, "the caches' rows hold no values");
  PD_CHECK(key_cache.shape()[2] == num_kv_heads, "the caches must have num_kv_heads heads");
  PD_CHECK(qkv.shape().size() == 2 && qkv.shape()[1] == (num_heads + 2 * num_kv_heads) * head_dim,
           "qkv must be [tokens, (H + 2 KVH) * D]");
  PD_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens, "one position and slot per token");
  PD_CHECK(cos.dtype() == paddle::DataType::FLOAT32 && cos.shape().size() == 2 && cos.shape()[1] == head_dim &&
               sin.shape() == cos.shape() && sin.dtype() == cos.dtype(),
           "cos/sin must be float32 [positions, head_dim]");
  glue::check_on_gpu(cos, "cos");
  glue::check_on_gpu(sin, "sin");
  auto query = paddle::empty({tokens, num_heads, head_dim}, qkv.dtype(), qkv.place());
  const Status status = dispatch_kv_dtypes(glue::dtype_of(qkv), cache.dtype, [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using Cache = decltype(cache_tag);
    const RopeWriteKvParams<T, Cache> p{glue::pointer<T>(qkv),
                                        positions.data<int64_t>(),
                                        cos.data<float>(),
                                        sin.data<float>(),
                                        slot_mapping.data<int64_t>(),
                                        glue::mutable_pointer<Cache>(key_cache),
                                        glue::mutable_pointer<Cache>(value_cache),
                                        glue::mutable_pointer<T>(query),
                                        tokens,
                                        key_cache.shape()[0] * key_cache.shape()[1],
                                        cos.shape()[0],
                                        num_heads,
                                        num_kv_heads,
                                        static_cast<int>(head_dim)};
    return launch_rope_write_kv(p, qkv.stream());
  });
  glue::check_launched(status, "bs_rope_write_kv");
  return {query};
}

// Causal attention of every query over its request's cache blocks: request r's queries are
// query rows query_start[r]..query_start[r + 1], at the last positions of its context_lens[r] tokens.
// sliding_window > 0: the query at position p sees keys max(0, p - sliding_window + 1)..p only;
// softcap > 0: scores s (q.k / sqrt(head_dim)) become softcap * tanh(s / softcap) before the softmax.
std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& query, const paddle::Tensor& key_cache,
                                           const paddle::Tensor& value_cache, const paddle::Tensor& query_start,
                                           const paddle::Tensor& context_lens, const paddle::Tensor& block_table,
                                           int query_tile, int sliding_window, float softcap, IsaAttr) {
  glue::check_on_gpu(query, "query");
  const CacheFormat cache = check_caches(key_cache, value_cache, query);
  for (const auto* indices : {&query_start, &context_lens, &block_table}) glue::check_indices(*indices, "an index");
  PD_CHECK(query.shape().size() == 3 && block_table.shape().size() == 2, "query [tokens, H, D], block_table 2-d");
  const AttentionShape shape{query.shape()[0],
                             context_lens.numel(),
                             block_table.shape()[1],
                             static_cast<int>(query.shape()[1]),
                             static_cast<int>(key_cache.shape()[2]),
                             static_cast<int>(query.shape()[2]),
                             static_cast<int>(key_cache.shape()[1]),
                             sliding_window};
  const char* problem = attention_shape_problem(shape);
  PD_CHECK(problem == nullptr, "bs_paged_attention: ", problem == nullptr ? "" : problem);
  const char* softcap_error = softcap_problem(softcap);
  PD_CHECK(softcap_error == nullptr, "bs_paged_attention: ", softcap_error == nullptr ? "" : softcap_error);
  PD_CHECK(cache.head_dim == shape.head_dim && query_tile > 0, "cache head_dim must match the query's");
  PD_CHECK(query_start.numel() == shape.num_requests + 1 && block_table.shape()[0] == shape.num_requests,
           "one row per request");
  auto out = paddle::empty({shape.num_tokens, shape.num_heads * shape.head_dim}, query.dtype(), query.place());
  if (shape.num_tokens == 0) return {out};
  const AttentionPlan plan = plan_attention(shape, query_tile, glue::multiprocessors(query));
  auto workspace =
      paddle::empty({std::max<int64_t>(plan.workspace_floats, 1)}, paddle::DataType::FLOAT32, query.place());
  const Status status = dispatch_kv_dtypes(glue::dtype_of(query), cache.dtype, [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using Cache = decltype(cache_tag);
    const PagedAttentionParams<T, Cache> p{glue::pointer<T>(query),
                                           glue::pointer<Cache>(key_cache),
                                           glue::pointer<Cache>(value_cache),
                                           query_start.data<int64_t>(),
                                           context_lens.data<int64_t>(),
                                           block_table.data<int64_t>(),
                                           glue::mutable_pointer<T>(out),
                                           workspace.data<float>(),
                                           shape,
                                           plan,
                                           1.0f / std::sqrt(static_cast<float>(shape.head_dim)),
                                           softcap};
    return launch_paged_attention(p, query.stream());
  });
  glue::check_launched(status, "bs_paged_attention");
  return {out};
}

}  // namespace

PD_BUILD_OP(bs_rope_write_kv)
    .Inputs({"Qkv", "Positions", "Cos", "Sin", "SlotMapping", "KeyCache", "ValueCache"})
    .Outputs({"Query", "KeyCacheOut", "ValueCacheOut"})
    .SetInplaceMap({{"KeyCache", "KeyCacheOut"}, {"ValueCache", "ValueCacheOut"}})
    .Attrs({"num_heads: int", "num_kv_heads: int", BS_ISA_ATTR})
    .SetKernelFn(PD_KERNEL(RopeWriteKv));

PD_BUILD_OP(bs_paged_attention)
    .Inputs({"Query", "KeyCache", "ValueCache", "QueryStart", "ContextLens", "BlockTable"})
    .Outputs({"Out"})
    .Attrs({"query_tile: int", "sliding_window: int", "softcap: float", BS_ISA_ATTR})
    .SetKernelFn(PD_KERNEL(PagedAttention));
