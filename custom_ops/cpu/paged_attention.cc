#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <omp.h>
#include <type_traits>
#include <vector>

namespace bs {
namespace {

// Each token asks for the cache lines of the token this many after it (its K and V slots, for writing) before it
// computes its own. A slot's lines are not in cache, and a store to a missing line waits for it: at 64 decodes the
// rope + KV write stage took 0.5-1.4 ms of a bf16 step (30 layers, AMD EPYC Zen 4, 2 threads), ~1 us a token
// for arithmetic that takes ~0.1. In-process pairs (24 steps each way, twice): the stage 0.81 and 0.83x with 4
// ahead, 0.85 and 0.84x with 12; whole steps 0.987-0.996x.
constexpr int64_t kWriteAhead = 4;

template <class Cache>
void rope_write(const KernelSet& kernels, const float* src, const StepTokens& tokens, const float* cos_table,
                const float* sin_table, float* q_out, Cache* k_cache, Cache* v_cache, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim) {
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim, kv_width = num_kv_heads * head_dim;
  const int64_t *pos = tokens.positions, *slots = tokens.slots;
  const int64_t slot_bytes = kv_width * static_cast<int64_t>(sizeof(Cache));
#pragma omp parallel for schedule(static) if (tokens.count * row >= kParallelFloats)
  for (int64_t t = 0; t < tokens.count; ++t) {
    if (t + kWriteAhead < tokens.count) {
      const char* key_ahead = reinterpret_cast<const char*>(k_cache + slots[t + kWriteAhead] * kv_width);
      const char* value_ahead = reinterpret_cast<const char*>(v_cache + slots[t + kWriteAhead] * kv_width);
      for (int64_t line = 0; line < slot_bytes; line += 64) {
        __builtin_prefetch(key_ahead + line, 1, 3);
        __builtin_prefetch(value_ahead + line, 1, 3);
      }
    }
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
  int64_t key_begin = 0, key_end = -1;  // key_end -1: all the keys its queries see
  int64_t partial = -1;                 // a split's offset in the partial results, or -1
};

// Fewer keys than this per part: a decode's keys are not split (into fewer parts), the merge would cost more.
constexpr int64_t kMinSplitKeys = 32;

template <class Cache>
AttentionTile<Cache> tile_of(const TileWork& item, const float* q, const KvCaches& caches,
                             const StepRequests& requests, int64_t num_heads, float* scratch, float* out,
                             float* partials) {
  const int64_t start = requests.query_start[item.request];
  const int64_t num_queries = requests.query_start[item.request + 1] - start;
  const int64_t first_position = requests.context_lens[item.request] - num_queries + item.first_query;
  return {q,
          static_cast<const Cache*>(caches.key),
          static_cast<const Cache*>(caches.value),
          requests.block_table + item.request * requests.table_width,
          out,
          scratch,
          start + item.first_query,
          item.num_queries,
          first_position,
          item.kv_head,
          item.num_kv_heads,
          num_heads,
          caches.num_kv_heads,
          caches.head_dim,
          caches.block_size,
          1.0f / std::sqrt(static_cast<float>(caches.head_dim)),
          nullptr,
          false,
          item.key_begin,
          item.key_end >= 0 ? item.key_end : first_position + item.num_queries,
          item.partial >= 0 ? partials + item.partial : nullptr};
}

// One decode's kv head whose keys `parts` one-head tiles share: part p's results for the head's `group` rows
// at partials + first + p * group * (head_dim + 2), as attend_tile leaves them.
struct Split {
  int64_t request, kv_head, parts, first;
};

// Each split's rows: the parts' sums of values weighted by exp(part max - max) and divided by the sum so
// weighted of their softmax sums (every part saw at least one key).
void merge_splits(const std::vector<Split>& splits, const float* partials, const StepRequests& requests,
                  int64_t num_heads, int64_t group, int64_t head_dim, float* out) {
  const int64_t stride = head_dim + 2;
  for (const Split& split : splits) {
    float* query_out = out + requests.query_start[split.request] * num_heads * head_dim;
    for (int64_t row = 0; row < group; ++row) {
      const float* first_part = partials + split.first + row * stride;
      float max = -INFINITY;
      for (int64_t p = 0; p < split.parts; ++p) max = std::max(max, first_part[p * group * stride + head_dim]);
      float* dst = query_out + (split.kv_head * group + row) * head_dim;
      std::fill(dst, dst + head_dim, 0.0f);
      float sum = 0.0f;
      for (int64_t p = 0; p < split.parts; ++p) {
        const float* part = first_part + p * group * stride;
        const float weight = std::exp(part[head_dim] - max);
        sum += weight * part[head_dim + 1];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] += weight * part[d];
      }
      for (int64_t d = 0; d < head_dim; ++d) dst[d] /= sum;
    }
  }
}

// Each thread takes the next tile of `work` one ahead of computing it (a shared counter: longest first,
// the threads end about together), so that its first span is asked for while the tile before computes.
template <class Cache>
void attend(void (*attend_tile)(const AttentionTile<Cache>&), const std::vector<TileWork>& work, const float* q,
            const KvCaches& caches, const StepRequests& requests, int64_t num_heads, int64_t scratch_floats,
            float* out, float* partials) {
  const int64_t num_items = static_cast<int64_t>(work.size());
  std::atomic<int64_t> next_item{0};
#pragma omp parallel if (num_items > 1)
  {
    std::vector<float> scratch(scratch_floats);
    int64_t current = next_item.fetch_add(1);
    bool prefetched = false;
    while (current < num_items) {
      const int64_t following = next_item.fetch_add(1);
      AttentionTile<Cache> tile =
          tile_of<Cache>(work[current], q, caches, requests, num_heads, scratch.data(), out, partials);
      AttentionTile<Cache> next_tile{};
      if (following < num_items) {
        next_tile = tile_of<Cache>(work[following], q, caches, requests, num_heads, scratch.data(), out, partials);
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

StepLayout step_layout(const paddle::Tensor& layout) {
  PD_CHECK(layout.is_cpu() && layout.dtype() == paddle::DataType::INT64 && layout.shape().size() == 1 &&
               layout.numel() >= 3,
           "a step layout is a 1-D int64 CPU tensor that begins with its numbers of tokens, requests and blocks per request");
  const int64_t* at = layout.data<int64_t>();
  const int64_t tokens = at[0], requests = at[1], width = at[2];
  PD_CHECK(tokens >= 0 && requests >= 0 && width >= 0 && tokens <= layout.numel() && requests <= layout.numel() &&
               (requests == 0 || width <= layout.numel() / requests) &&
               layout.numel() == 3 + 3 * tokens + 2 * requests + 1 + requests * width,
           "a step layout of ", tokens, " tokens and ", requests, " requests of ", width, " blocks holds ",
           layout.numel(), " numbers");
  const int64_t* ids = at + 3;
  const int64_t* positions = ids + tokens;
  const int64_t* query_start = positions + 2 * tokens;
  return {ids,
          {positions, positions + tokens, tokens},
          {query_start, query_start + requests + 1, requests, query_start + 2 * requests + 1, width}};
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
  std::vector<Split> splits;
  int64_t scratch_floats = 0, num_partial_floats = 0;
  // Fewer requests than threads (a decode of one sequence): a decode's keys are split into parts over the
  // threads, a tile per kv head and part, merged after (flash-decoding); other queries get a tile per kv head.
  // (A part's kv heads in one tile, read slot by slot as a decode tile of many requests reads them, measured
  // slower: 2.3-2.5 ms against 2.1 unsplit for one sequence at 2000 keys, one-head parts 1.7-1.9, both in a
  // version whose later parts asked for the wrong first span; one-head parts after the fix 1.9-2.0. At 128 keys,
  // the decode stack's attention stage over 30 layers, paired step by step in one process against one-head parts:
  // a part's kv heads in one tile 864 / 591 and 813 / 559 us (gguf), 894 / 649 (bf16); with one-head parts, the
  // tiles' asks made at once when a tile begins 695 / 515, the next tile's at once 633 / 497, none 856 / 555.)
  const int64_t num_threads = omp_get_max_threads();
  const bool few_requests = requests.count < num_threads;
  const int64_t parts_per_request = (num_threads + requests.count - 1) / std::max<int64_t>(requests.count, 1);
  for (int64_t r = 0; r < requests.count; ++r) {
    const int64_t num_queries = starts[r + 1] - starts[r];
    PD_CHECK(num_queries >= 0 && num_queries <= lens[r] && starts[r + 1] <= num_tokens, "bad query_start/context_lens");
    PD_CHECK((lens[r] + block_size - 1) / block_size <= width, "block table too narrow for the context");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b) {
      PD_CHECK(table[r * width + b] >= 0 && table[r * width + b] < caches.num_blocks, "block id outside the cache");
    }
    // A decode's parts: 1 unless few_requests (parts_per_request is 1 then), or its keys are too few.
    const int64_t parts = num_queries == 1 ? std::min(parts_per_request, lens[r] / kMinSplitKeys) : 1;
    if (parts > 1) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        splits.push_back({r, h, parts, num_partial_floats});
        for (int64_t part = 0; part < parts; ++part) {
          const int64_t begin = lens[r] * part / parts, end = lens[r] * (part + 1) / parts;
          work.push_back({r, 0, 1, h, 1, end - begin, begin, end, num_partial_floats});
          num_partial_floats += group * (head_dim + 2);
        }
      }
      scratch_floats = std::max(scratch_floats, attention_scratch_floats(1, 1, group, head_dim));
      continue;
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
  std::vector<float> partials(num_partial_floats);
  if (caches.bf16) {
    attend(kernels.attend_tile_bf16, work, query, caches, requests, num_heads, scratch_floats, out, partials.data());
  } else {
    attend(kernels.attend_tile, work, query, caches, requests, num_heads, scratch_floats, out, partials.data());
  }
  merge_splits(splits, partials.data(), requests, num_heads, group, head_dim, out);
}

}  // namespace bs
