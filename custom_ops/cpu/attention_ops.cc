// The attention ops: the rotary embedding + KV-cache write (bs_rope_write_kv) and the paged attention
// (bs_paged_attention) of paged_attention.h.
#include <vector>

#include "cpu_isa.h"
#include "kernel_set.h"
#include "paddle/extension.h"
#include "paged_attention.h"

namespace {

std::vector<paddle::Tensor> RopeWriteKv(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                        const paddle::Tensor& cos, const paddle::Tensor& sin,
                                        const paddle::Tensor& slot_mapping, paddle::Tensor& key_cache,
                                        paddle::Tensor& value_cache, int num_heads, int num_kv_heads, int isa) {
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa));
  bs::KvCaches caches = bs::kv_caches(key_cache, value_cache);
  const int64_t tokens = qkv.shape()[0], head_dim = caches.head_dim;
  PD_CHECK(caches.num_kv_heads == num_kv_heads, "the caches hold num_kv_heads heads");
  PD_CHECK(qkv.shape()[1] == (num_heads + 2 * num_kv_heads) * head_dim, "qkv must be [tokens, (H + 2 KVH) * D]");
  PD_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens, "one position and slot per token");
  PD_CHECK(cos.shape()[1] == head_dim && sin.shape() == cos.shape(), "cos/sin must be [positions, head_dim]");
  auto query = paddle::empty({tokens, num_heads, head_dim}, paddle::DataType::FLOAT32, qkv.place());
  bs::rope_write_kv(kernels, qkv.data<float>(), {positions.data<int64_t>(), slot_mapping.data<int64_t>(), tokens},
                    cos.data<float>(), sin.data<float>(), cos.shape()[0], num_heads, caches, query.data<float>());
  return {query};
}

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& query, const paddle::Tensor& key_cache,
                                           const paddle::Tensor& value_cache, const paddle::Tensor& query_start,
                                           const paddle::Tensor& context_lens, const paddle::Tensor& block_table,
                                           int query_tile, int sliding_window, float softcap, int isa) {
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa));
  const bs::KvCaches caches = bs::kv_caches(key_cache, value_cache);
  const int64_t tokens = query.shape()[0], num_heads = query.shape()[1];
  PD_CHECK(query.shape()[2] == caches.head_dim, "query and caches must have one head_dim");
  const int64_t num_requests = context_lens.numel();
  PD_CHECK(query_start.numel() == num_requests + 1 && block_table.shape()[0] == num_requests, "one row per request");
  auto out = paddle::empty({tokens, num_heads * caches.head_dim}, paddle::DataType::FLOAT32, query.place());
  const bs::StepRequests requests{query_start.data<int64_t>(), context_lens.data<int64_t>(), num_requests,
                                  block_table.data<int64_t>(), block_table.shape()[1]};
  bs::paged_attention(kernels, query.data<float>(), tokens, num_heads, caches, requests, query_tile, out.data<float>(),
                      sliding_window, softcap);
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
    .Attrs({"query_tile: int", "sliding_window: int", "softcap: float", "isa: int"})
    .SetKernelFn(PD_KERNEL(PagedAttention));
