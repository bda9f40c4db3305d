// The attention of one layer over the paged KV cache, as plain functions over checked tensors: the
// rotary embedding + KV-cache write, and the causal attention reading the cache blocks in place. Used by
// the single ops (attention_ops.cc) and the fused decoder stack (decoder_stack_op.cc).
#pragma once

#include <cstdint>
#include <variant>
#include <vector>

#include "kernel_set.h"
#include "paddle/extension.h"

namespace bs {

// A layer's K and V caches of element type T: [num_blocks, block_size, num_kv_heads, kv_row_elements<T>(head_dim)]
// each (a scaled type's rows end in their scales; an int8 cache in groups holds the same bytes, kv_types.h).
template <class T>
struct KvStorage {
  T* key;
  T* value;
};
template <class List>
struct KvStorageOf;
template <class... Ts>
struct KvStorageOf<TypeList<Ts...>> {
  using type = std::variant<KvStorage<Ts>...>;
};

// A layer's K and V caches, of one element type of KvElementTypes (std::visit on `storage` names it).
struct KvCaches {
  KvStorageOf<KvElementTypes>::type storage;
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
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
// worker/attention/metadata.py's HostAttentionMetadata.layout): the numbers of tokens and requests and the block
// table's width, then ids[tokens], positions[tokens], slots[tokens], query_start[requests + 1],
// context_lens[requests] and the block table's rows. Checks the sizes add up; the values are checked where they
// are used.
struct StepLayout {
  const int64_t* ids;  // the tokens' ids, [tokens.count]
  StepTokens tokens;
  StepRequests requests;
};
StepLayout step_layout(const paddle::Tensor& layout);

// Checks each token's position (inside the rotary table's max_position) and slot (one of the caches' num_slots).
void check_step_tokens(const StepTokens& tokens, int64_t max_position, int64_t num_slots);

// Rotates q and k of the fused qkv [tokens, (heads + 2 * kv_heads) * head_dim] by each token's position
// (cos/sin: [max_position, head_dim]), stores k and v at the token's slot (as the cache's element type) and
// the rotated q in query [tokens, heads, head_dim]. Checks the tokens first (check_step_tokens);
// rope_write_checked_kv is the same for tokens already checked against the caches' shape.
void rope_write_kv(const KernelSet& kernels, const float* qkv, const StepTokens& tokens, const float* cos,
                   const float* sin, int64_t max_position, int64_t num_heads, KvCaches& caches, float* query);
void rope_write_checked_kv(const KernelSet& kernels, const float* qkv, const StepTokens& tokens, const float* cos,
                           const float* sin, int64_t num_heads, KvCaches& caches, float* query);

// One tile of a step's attention: request `request`'s queries [first_query, first_query + num_queries) for its kv
// heads [kv_head, kv_head + num_kv_heads), over keys [key_begin, key_end); cost orders the tiles.
struct TileWork {
  int64_t request, first_query, num_queries, kv_head, num_kv_heads, cost;
  int64_t key_begin = 0, key_end = -1;  // key_end -1: all the keys its queries see
  int64_t partial = -1;                 // a split's offset in the partial results, or -1
};

// One decode's kv head whose keys `parts` one-head tiles share: part p's results for the head's `group` rows
// at partials + first + p * group * (head_dim + 2), as attend_tile leaves them.
struct Split {
  int64_t request, kv_head, parts, first;
};

// A step's attention tiles, made and checked once from its requests for caches of one shape (block size and
// count, kv heads, head_dim), and the same for every layer of the step: the decoder stack plans once a step
// instead of once a layer (the checks and the tile list took ~3-8 us of each layer's attention at 64 decodes).
struct AttentionPlan {
  std::vector<TileWork> work;  // longest first
  int64_t window = 0;          // a sliding window (0: none): the tiles read only the keys their queries' windows hold
  float softcap = 0.0f;        // scores capped at softcap * tanh(score / softcap) (0: not capped)
  std::vector<Split> splits;
  int64_t scratch_floats = 0, num_partial_floats = 0;  // per thread; all the splits' partial results
  int64_t num_heads = 0, num_blocks = 0, block_size = 0, num_kv_heads = 0, head_dim = 0;
  // Every request is one query (a decode), and each tile takes one request's every kv head: a tile can write its
  // own token's K and V (DecodeRope) before it reads them, and no other tile reads them.
  bool fuses_rope = false;
};
AttentionPlan plan_attention(const StepRequests& requests, int64_t num_tokens, int64_t num_heads,
                             const KvCaches& caches, int query_tile, int64_t window = 0, float softcap = 0.0f);

// A decode step's rotary embedding and KV-cache write (rope_write_kv's, for checked tokens), done inside the
// attention: each tile rotates its own token's q and k into `query` and the cache just before it attends. This
// spares the step a parallel region a layer, and the write's misses overlap the tile before (it asks for the next
// tile's slots to write). Measured with the plan made once a step, against both per layer and the rope a stage of
// its own (AMD EPYC Zen 4, 2 threads, 128-token prompts; steps paired in one process, 12-40 pairs a run): rope +
// attention 0.911-0.998 of before, median 0.959 over 7 runs (bf16 at 64 decodes three times, fp32 and gguf at 64,
// bf16 at 8, gguf at 1); whole steps 0.989-1.014, within the host's noise. The stage's work mostly moves into the
// tiles (bf16 at 64: rope 460 us, attention 8706 before; 14 and 9080 after): a slot's write still misses.
struct DecodeRope {
  const KernelSet* kernels;
  const float* qkv;  // [tokens, (heads + 2 * kv_heads) * head_dim]
  StepTokens tokens;
  const float *cos, *sin;
  float* query;  // the attention's query, written here
};

// out [tokens, heads * head_dim] = causal attention of query [tokens, heads, head_dim] over each request's
// cache blocks, by `plan` (made for these requests and caches of this shape); with `rope` (a plan that
// fuses_rope), each tile first writes its token's q, k and v. The overload plans the call itself: `query_tile`
// queries of a request share one pass over its keys.
void paged_attention(const KernelSet& kernels, const AttentionPlan& plan, const float* query, const KvCaches& caches,
                     const StepRequests& requests, float* out, const DecodeRope* rope = nullptr);
// `window` (0: none): each query sees only the `window` keys up to its own (Mistral's, Gemma's sliding layers);
// `softcap` (0: none): scores become softcap * tanh(score / softcap) before the softmax (Gemma 2).
void paged_attention(const KernelSet& kernels, const float* query, int64_t num_tokens, int64_t num_heads,
                     const KvCaches& caches, const StepRequests& requests, int query_tile, float* out,
                     int64_t window = 0, float softcap = 0.0f);

}  // namespace bs
