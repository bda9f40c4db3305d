// The ISA-specific kernels behind the ops: one table per instruction set, picked per call.
// Plain types only: this header is also included inside the AVX2/AVX-512 translation units.
#pragma once

#include <cstdint>

#include "isa.h"
#include "kv_types.h"

namespace bs {

// Keys scored together in one online-softmax update of attend_tile.
constexpr int64_t kKeySpan = 128;
// Kv heads one attention tile may cover (decode tiles cover all of a request's heads).
constexpr int64_t kMaxTileKvHeads = 16;
// Below this many floats of work a row-wise op runs on one thread: a second one costs more than it saves,
// and a decode step of one sequence calls these ops 120 times (measured when the worker's threads waited
// passively; since they spin a while (worker/host/cpu_threads.py) a lower bound may pay, not measured).
constexpr int64_t kParallelFloats = 1 << 15;

// Queries of one request at consecutive positions (a query tile), for one or more consecutive kv heads, over caches
// of element type Cache (kv_types.h).
template <class Cache>
struct AttentionTile {
  const float* query;        // [tokens, num_heads, head_dim]
  const Cache* key_cache;    // [num_blocks, block_size, num_kv_heads, row]: rows of head_dim values (kv_types.h),
                             // or an int8 cache's groups (int8_groups: the same bytes)
  const Cache* value_cache;  // same layout
  const int64_t* block_ids;  // the request's block-table row
  float* out;                // [tokens, num_heads * head_dim]
  float* scratch;            // attention_scratch_floats(...) floats, one buffer per thread
  int64_t first_token;       // flat index of the tile's first query
  int64_t num_queries;
  int64_t first_position;  // absolute position of the first query; query i sees keys 0..first_position + i
                           // (with a window, first_position + i - window + 1..first_position + i)
  int64_t kv_head;            // the tile's first kv head
  int64_t num_tile_kv_heads;  // kv heads of the tile, at most kMaxTileKvHeads
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  // The tile this thread computes next (null: none): its first span's slots are asked for while this
  // tile computes, a few at each group of keys, so that its misses overlap this tile's arithmetic.
  const AttentionTile* next;
  bool first_span_prefetched;  // the tile before asked for this one's first span already
  // The keys the tile reads, [key_begin, key_end): all of them (0, first_position + num_queries), or a part of
  // a decode's (a split: the threads share one request's keys).
  int64_t key_begin, key_end;
  // Null, or where a split leaves its rows' partial results for paged_attention to merge: per kv head of the
  // tile and row, head_dim unnormalized sums of values (the head's order), then the row's max score and sum.
  float* partial;
  // A sliding window (0: none): query i sees only the `window` keys up to its own. key_begin is then at most
  // kKeySpan - num_queries keys before the first query's window: each row sees a key of the tile's first span.
  int64_t window;
  float softcap;  // scores become softcap * tanh(score / softcap) before the softmax (0: not capped)
  // An int8 cache in groups (kv_types.h: Int8Groups) rather than rows: int8_cache_in_groups.
  bool int8_groups = false;
};

// Scratch of a tile of `queries` queries over `tile_kv_heads` kv heads: each head's scores of a span, its rows' queries,
// accumulators and softmax state; then a span's keys in lanes (32-bit words, head_dim / 2 per key).
inline int64_t attention_scratch_floats(int64_t queries, int64_t tile_kv_heads, int64_t group, int64_t head_dim) {
  const int64_t rows = queries * group;  // per kv head
  return tile_kv_heads * rows * kKeySpan + tile_kv_heads * rows * (2 * head_dim + 2) + kKeySpan * head_dim / 2;
}

// Entries of a drawn row this far below the largest in probability are never drawn (e^-69; the clamped
// exp of the kernels reaches ~4e-39).
constexpr float kMinDrawnMass = 1e-30f;
// Entries per sum of draw_masses (whole vectors of every instruction set).
constexpr int64_t kDrawGroup = 16;

// The kernels that write or read a KV cache of element type T (kv_types.h).
template <class T>
struct KvKernels {
  // Rotary embedding of one key head into the cache: KernelSet::rotate_head's, each value stored as a T.
  void (*rotate_head)(const float* x, const float* cos, const float* sin, T* out, int64_t head_dim);
  // A token's values x [num_rows, head_dim] into its slot as T, row by row (kv_row_elements<T> apart).
  void (*store)(const float* x, T* out, int64_t head_dim, int64_t num_rows);
  void (*attend_tile)(const AttentionTile<T>& tile);
};

// One KvKernels per element type of a TypeList.
template <class List>
struct KvKernelsOf;
template <class... Ts>
struct KvKernelsOf<TypeList<Ts...>> : KvKernels<Ts>... {};

struct KernelSet {
  // out = x_sum * rsqrt(mean(x_sum^2) + eps) * weight, x_sum = x + residual (residual may be null);
  // x_sum is stored to `summed` unless it is null.
  void (*rms_norm_row)(const float* x, const float* residual, const float* weight, float* out, float* summed,
                       int64_t width, float eps);
  // out[i] = silu(gate_up[i]) * gate_up[width + i]
  void (*silu_and_mul_row)(const float* gate_up, float* out, int64_t width);
  // Rotary embedding of one head, Hugging Face layout (halves): cos/sin are the position's first half_dim entries.
  void (*rotate_head)(const float* x, const float* cos, const float* sin, float* out, int64_t head_dim);
  // The index of the largest of x[0..width), the first if tied (greedy sampling).
  int64_t (*argmax_row)(const float* x, int64_t width);
  // The masses of a draw from softmax(x / temperature) over x[0..width): masses[i] = exp(x[i] / temperature - the
  // largest), 0 where under min_p (<= 1) or kMinDrawnMass (the largest's mass is 1; NaN: 0); group_sums[g]
  // their fp32 sum over entries [g * kDrawGroup, (g + 1) * kDrawGroup) (the last group may be short). Returns
  // the sum of group_sums in fp64.
  double (*draw_masses)(const float* x, int64_t width, float temperature, float min_p, float* masses,
                        float* group_sums);
  KvKernelsOf<KvElementTypes> kv;  // the cache kernels of every element type: for_cache<T>()
  // The kernel sets with AVX512-VNNI keep an int8 cache whose shape fits (int8_groups_fit) in groups (kv_types.h:
  // Int8Groups), not rows, and write it by this (null in the others): a token's K [num_kv_heads, head_dim] (rotated
  // here by cos/sin, the position's) and V encoded as rows are (kv_element.h) and placed in their groups at `slot`.
  // The caches' layout follows the kernel set a worker runs (fixed at its start).
  void (*write_int8_groups)(const float* key, const float* value, const float* cos, const float* sin, int64_t slot,
                            Int8* k_cache, Int8* v_cache, int64_t num_kv_heads, int64_t head_dim);

  template <class T>
  const KvKernels<T>& for_cache() const {
    return kv;
  }
};

const KernelSet& avx2_kernels();
const KernelSet& avx512_kernels();
// AVX-512's, with a bf16 cache's attention by vdpbf16ps and an int8 cache's keys by vpdpbusd.
const KernelSet& avx512_bf16_kernels();
const KernelSet& amx_kernels();  // AVX512-BF16's, with a bf16 cache's prefill attention on AMX tiles

// Whether an int8 cache of this shape is in groups for `kernels` (kv_types.h: Int8Groups).
inline bool int8_cache_in_groups(const KernelSet& kernels, int64_t block_size, int64_t head_dim) {
  return kernels.write_int8_groups != nullptr && int8_groups_fit(block_size, head_dim);
}

// AMX implies AVX512-BF16 and AVX512-VNNI (isa.h); every CPU with AVX512-BF16 has VNNI.
inline const KernelSet& kernels_for(const Isa& isa) {
  return isa.amx                 ? amx_kernels()
         : isa.bf16 && isa.vnni  ? avx512_bf16_kernels()
         : isa.avx512            ? avx512_kernels()
                                 : avx2_kernels();
}

}  // namespace bs
