// The attention of one layer over the paged KV cache, as plain functions over checked tensors: the
// rotary embedding + KV-cache write, and the causal attention reading the cache blocks in place. Used by
// the single ops (attention_ops.cc) and the fused decoder stack (decoder_stack_op.cc).
#pragma once

#include <cstdint>

#include "kernel_set.h"
#include "paddle/extension.h"

namespace bs {

// A layer's K and V caches: [num_blocks, block_size, num_kv_heads, head_dim], both float32 or both bfloat16.
struct KvCaches {
  void* key;
  void* value;
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
  bool bf16;
};

// Checked views of a layer's caches (written through by rope_write_kv: in-place outputs of the ops).
KvCaches kv_caches(const paddle::Tensor& key_cache, const paddle::Tensor& value_cache);

// The tokens of one step: a position and a cache slot each (slot = block_id * block_size + offset).
struct StepTokens {
  const int64_t* positions;
  const int64_t* slots;
  int64_t count;
};

// The requests of one step: request r's queries are rows query_start[r]..query_start[r + 1] of the step's
// tokens, at the last positions of its context_lens[r] tokens, whose blocks are block_table[r].
struct StepRequests {
  const int64_t* query_start;
  const int64_t* context_lens;
  int64_t count;
  const int64_t* block_table;
  int64_t table_width;
};

// A step's tokens and requests read from one int64 CPU tensor (bs_decoder_stack's StepLayout, made by
// gpu_worker/custom_attention.py's HostAttentionMetadata.layout): the numbers of tokens and requests and the block
// table's width, then ids[tokens], positions[tokens], slots[tokens], query_start[requests + 1],
// context_lens[requests] and the block table's rows. Checks the sizes add up; the values are checked where they
// are used.
struct StepLayout {
  const int64_t* ids;  // the tokens' ids, [tokens.count]
  StepTokens tokens;
  StepRequests requests;
};
StepLayout step_layout(const paddle::Tensor& layout);

// Rotates q and k of the fused qkv [tokens, (heads + 2 * kv_heads) * head_dim] by each token's position
// (cos/sin: [max_position, head_dim]), stores k and v at the token's slot (rounded to bf16 in a bf16
// cache) and the rotated q in query [tokens, heads, head_dim].
void rope_write_kv(const KernelSet& kernels, const float* qkv, const StepTokens& tokens, const float* cos,
                   const float* sin, int64_t max_position, int64_t num_heads, KvCaches& caches, float* query);

// out [tokens, heads * head_dim] = causal attention of query [tokens, heads, head_dim] over each request's
// cache blocks; `query_tile` queries of a request share one pass over its keys.
void paged_attention(const KernelSet& kernels, const float* query, int64_t num_tokens, int64_t num_heads,
                     const KvCaches& caches, const StepRequests& requests, int query_tile, float* out);

}  // namespace bs
