#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <omp.h>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace bs {
namespace {

// The Paddle dtype of each KV element type (kv_types.h): a type without one does not compile.
template <class T>
struct KvDtype;
template <>
struct KvDtype<float> {
  static constexpr paddle::DataType value = paddle::DataType::FLOAT32;
};
template <>
struct KvDtype<Bf16> {
  static constexpr paddle::DataType value = paddle::DataType::BFLOAT16;
};
template <>
struct KvDtype<Int8> {
  static constexpr paddle::DataType value = paddle::DataType::INT8;
};
// uint8: Paddle's CPU kernels take no float8 tensor (numel has none), and the rows hold their scales' bytes too.
template <>
struct KvDtype<Fp8E4M3> {
  static constexpr paddle::DataType value = paddle::DataType::UINT8;
};

// "float32, bfloat16": the dtypes a cache may have.
std::string kv_dtype_names() {
  std::string names;
  for_each_type(KvElementTypes{}, [&](auto tag) {
    names += (names.empty() ? "" : ", ") + phi::DataTypeToString(KvDtype<typename decltype(tag)::type>::value);
  });
  return names;
}

// Each token asks for the cache lines of the token this many after it (its K and V slots, for writing) before it
// computes its own. A slot's lines are not in cache, and a store to a missing line waits for it: at 64 decodes the
// rope + KV write stage took 0.5-1.4 ms of a bf16 step (30 layers, AMD EPYC Zen 4, 2 threads), ~1 us a token
// for arithmetic that takes ~0.1. In-process pairs (24 steps each way, twice): the stage 0.81 and 0.83x with 4
// ahead, 0.85 and 0.84x with 12; whole steps 0.987-0.996x.
constexpr int64_t kWriteAhead = 4;

// Asks for the cache lines of a slot's K and V (slot_width elements each), to write.
template <class Cache>
inline void ask_to_write(const Cache* k_cache, const Cache* v_cache, int64_t slot, int64_t slot_width) {
  const char* key = reinterpret_cast<const char*>(k_cache + slot * slot_width);
  const char* value = reinterpret_cast<const char*>(v_cache + slot * slot_width);
  for (int64_t line = 0; line < slot_width * static_cast<int64_t>(sizeof(Cache)); line += 64) {
    __builtin_prefetch(key + line, 1, 3);
    __builtin_prefetch(value + line, 1, 3);
  }
}

// The same for an int8 cache in groups (kv_types.h): the lines the slot's codes and scales lie in, of each kv head's
// group (a key's codes are a 4-byte word in each of head_dim / 4 lines, a value's in 4 * head_dim bytes).
inline void ask_to_write_groups(const Int8* k_cache, const Int8* v_cache, int64_t slot, int64_t num_kv_heads,
                                int64_t head_dim) {
  const int64_t lane = slot % Int8Groups::kSlots, bytes = Int8Groups::bytes(head_dim);
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const int64_t group = Int8Groups::index(slot, h, num_kv_heads) * bytes;
    const char* key = reinterpret_cast<const char*>(k_cache + group);
    const char* value = reinterpret_cast<const char*>(v_cache + group + Int8Groups::value_code(lane, 0, head_dim));
    for (int64_t line = 0; line < 16 * head_dim; line += 64) __builtin_prefetch(key + line, 1, 3);
    for (int64_t line = 0; line < 4 * head_dim; line += 64) __builtin_prefetch(value + line, 1, 3);
    __builtin_prefetch(key + Int8Groups::scale(lane, head_dim), 1, 3);
    __builtin_prefetch(value - Int8Groups::value_code(lane, 0, head_dim) + Int8Groups::scale(lane, head_dim), 1, 3);
  }
}

template <class Cache>
inline void ask_to_write(const Cache* k_cache, const Cache* v_cache, int64_t slot, int64_t num_kv_heads,
                         int64_t head_dim, bool in_groups) {
  if constexpr (std::is_same_v<Cache, Int8>) {
    if (in_groups) return ask_to_write_groups(k_cache, v_cache, slot, num_kv_heads, head_dim);
  }
  ask_to_write(k_cache, v_cache, slot, num_kv_heads * kv_row_elements<Cache>(head_dim));
}

// Whether caches of element type Cache are in groups for `kernels` (an int8 cache: int8_cache_in_groups).
template <class Cache>
inline bool caches_in_groups(const KernelSet& kernels, const KvCaches& caches) {
  return std::is_same_v<Cache, Int8> && int8_cache_in_groups(kernels, caches.block_size, caches.head_dim);
}

// One token's rotary embedding and KV write: q_row [heads, head_dim], its K and V at `slot` (an int8 cache
// in_groups: in its groups, kv_types.h).
template <class Cache>
inline void rope_write_token(const KernelSet& kernels, const float* token, int64_t position, int64_t slot,
                             const float* cos_table, const float* sin_table, float* q_row, Cache* k_cache,
                             Cache* v_cache, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             bool in_groups) {
  const KvKernels<Cache>& cache_kernels = kernels.for_cache<Cache>();
  const int64_t kv_width = num_kv_heads * head_dim, row = kv_row_elements<Cache>(head_dim);
  const float *c = cos_table + position * head_dim, *s = sin_table + position * head_dim;
  for (int64_t h = 0; h < num_heads; ++h) {
    kernels.rotate_head(token + h * head_dim, c, s, q_row + h * head_dim, head_dim);
  }
  const float* key = token + num_heads * head_dim;
  if constexpr (std::is_same_v<Cache, Int8>) {
    if (in_groups) {
      return kernels.write_int8_groups(key, key + kv_width, c, s, slot, k_cache, v_cache, num_kv_heads, head_dim);
    }
  }
  Cache* key_slot = k_cache + slot * num_kv_heads * row;
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    cache_kernels.rotate_head(key + h * head_dim, c, s, key_slot + h * row, head_dim);
  }
  cache_kernels.store(key + kv_width, v_cache + slot * num_kv_heads * row, head_dim, num_kv_heads);
}

template <class Cache>
void rope_write(const KernelSet& kernels, const float* src, const StepTokens& tokens, const float* cos_table,
                const float* sin_table, float* q_out, Cache* k_cache, Cache* v_cache, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim, bool in_groups) {
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t *pos = tokens.positions, *slots = tokens.slots;
#pragma omp parallel for schedule(static) if (tokens.count * row >= kParallelFloats)
  for (int64_t t = 0; t < tokens.count; ++t) {
    // In groups, a slot's lines are those of the slot before it in its group (a prompt's): asked for already.
    const int64_t ahead = t + kWriteAhead;
    if (ahead < tokens.count &&
        !(in_groups && slots[ahead] % Int8Groups::kSlots != 0 && slots[ahead] == slots[ahead - 1] + 1)) {
      ask_to_write(k_cache, v_cache, slots[ahead], num_kv_heads, head_dim, in_groups);
    }
    rope_write_token(kernels, src + t * row, pos[t], slots[t], cos_table, sin_table, q_out + t * num_heads * head_dim,
                     k_cache, v_cache, num_heads, num_kv_heads, head_dim, in_groups);
  }
}

// Fewer keys than this per part: a decode's keys are not split (into fewer parts), the merge would cost more.
constexpr int64_t kMinSplitKeys = 32;

template <class Cache>
AttentionTile<Cache> tile_of(const TileWork& item, const AttentionPlan& plan, const float* q,
                             const KvStorage<Cache>& storage, const KvCaches& caches, const StepRequests& requests,
                             float* scratch, float* out, float* partials) {
  const int64_t num_heads = plan.num_heads;
  const int64_t start = requests.query_start[item.request];
  const int64_t num_queries = requests.query_start[item.request + 1] - start;
  const int64_t first_position = requests.context_lens[item.request] - num_queries + item.first_query;
  return {q,
          storage.key,
          storage.value,
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
          item.partial >= 0 ? partials + item.partial : nullptr,
          plan.window,
          plan.softcap};
}

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
// the threads end about together), so that its first span is asked for while the tile before computes. With
// `rope`, a tile first writes its token's q, k and v, and asks for the next tile's slots to write. (Each thread
// taking every n-th tile instead, with no shared counter, measured no faster at 64 decodes: bf16 attention 1.034
// and 0.995 of the counter's, steps paired in one process.)
template <class Cache>
void attend(void (*attend_tile)(const AttentionTile<Cache>&), const AttentionPlan& plan, const float* q,
            const KvStorage<Cache>& storage, const KvCaches& caches, const StepRequests& requests, float* out,
            float* partials, const DecodeRope* rope, bool in_groups) {
  const std::vector<TileWork>& work = plan.work;
  const int64_t num_heads = plan.num_heads, scratch_floats = plan.scratch_floats;
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
          tile_of<Cache>(work[current], plan, q, storage, caches, requests, scratch.data(), out, partials);
      tile.int8_groups = in_groups;
      AttentionTile<Cache> next_tile{};
      if (following < num_items) {
        next_tile =
            tile_of<Cache>(work[following], plan, q, storage, caches, requests, scratch.data(), out, partials);
        next_tile.int8_groups = in_groups;
        tile.next = &next_tile;
      }
      tile.first_span_prefetched = prefetched;
      if (rope != nullptr) {
        const int64_t t = tile.first_token, head_dim = caches.head_dim;
        if (following < num_items) {
          ask_to_write(storage.key, storage.value, rope->tokens.slots[next_tile.first_token], caches.num_kv_heads,
                       head_dim, in_groups);
        }
        rope_write_token(*rope->kernels, rope->qkv + t * (num_heads + 2 * caches.num_kv_heads) * head_dim,
                         rope->tokens.positions[t], rope->tokens.slots[t], rope->cos, rope->sin,
                         rope->query + t * num_heads * head_dim, storage.key, storage.value, num_heads,
                         caches.num_kv_heads, head_dim, in_groups);
      }
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
  }
  PD_CHECK(key_cache.dtype() == value_cache.dtype() && key_cache.shape() == value_cache.shape(),
           "the key and value caches must match");
  const auto& shape = key_cache.shape();
  KvCaches caches{{}, shape[0], shape[1], shape[2], shape[3]};
  bool typed = false;
  for_each_type(KvElementTypes{}, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (key_cache.dtype() != KvDtype<T>::value) return;
    caches.storage = KvStorage<T>{static_cast<T*>(const_cast<void*>(key_cache.data())),
                                  static_cast<T*>(const_cast<void*>(value_cache.data()))};
    // A scaled type's rows end in their scales: [num_blocks, block_size, kv_heads, head_dim + scale elements].
    constexpr int64_t extra = KvRowLayout<T>::kScaleElements;
    PD_CHECK(shape[3] > extra && (extra == 0 || shape[3] - extra <= kMaxScaledHeadDim),
             "a ", key_cache.dtype(), " cache's rows are head_dim values and ", extra, " elements of scale, head_dim ",
             "at most ", kMaxScaledHeadDim, ", not ", shape[3], " elements");
    caches.head_dim = shape[3] - extra;
    typed = true;
  });
  PD_CHECK(typed, "a cache's dtype must be one of ", kv_dtype_names(), ", not ", key_cache.dtype());
  return caches;
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

void check_step_tokens(const StepTokens& tokens, int64_t max_position, int64_t num_slots) {
  for (int64_t t = 0; t < tokens.count; ++t) {
    PD_CHECK(tokens.positions[t] >= 0 && tokens.positions[t] < max_position, "position outside the rotary table");
    PD_CHECK(tokens.slots[t] >= 0 && tokens.slots[t] < num_slots, "slot outside the cache");
  }
}

void rope_write_checked_kv(const KernelSet& kernels, const float* qkv, const StepTokens& tokens, const float* cos,
                           const float* sin, int64_t num_heads, KvCaches& caches, float* query) {
  std::visit(
      [&](const auto& storage) {
        rope_write(kernels, qkv, tokens, cos, sin, query, storage.key, storage.value, num_heads, caches.num_kv_heads,
                   caches.head_dim, caches_in_groups<std::remove_pointer_t<decltype(storage.key)>>(kernels, caches));
      },
      caches.storage);
}

void rope_write_kv(const KernelSet& kernels, const float* qkv, const StepTokens& tokens, const float* cos,
                   const float* sin, int64_t max_position, int64_t num_heads, KvCaches& caches, float* query) {
  check_step_tokens(tokens, max_position, caches.num_blocks * caches.block_size);
  rope_write_checked_kv(kernels, qkv, tokens, cos, sin, num_heads, caches, query);
}

void paged_attention(const KernelSet& kernels, const float* query, int64_t num_tokens, int64_t num_heads,
                     const KvCaches& caches, const StepRequests& requests, int query_tile, float* out, int64_t window,
                     float softcap) {
  paged_attention(kernels, plan_attention(requests, num_tokens, num_heads, caches, query_tile, window, softcap), query,
                  caches, requests, out);
}

AttentionPlan plan_attention(const StepRequests& requests, int64_t num_tokens, int64_t num_heads,
                             const KvCaches& caches, int query_tile, int64_t window, float softcap) {
  const int64_t num_kv_heads = caches.num_kv_heads, head_dim = caches.head_dim, block_size = caches.block_size;
  PD_CHECK(num_heads % num_kv_heads == 0 && head_dim % 16 == 0 && query_tile > 0, "unsupported attention shape");
  PD_CHECK(window >= 0 && softcap >= 0.0f, "a sliding window and a soft cap are positive, or 0 for none");
  // With a window, a tile's rows see keys from at most query_tile - 1 after its first query's window start: fewer
  // than a span, so that each row sees a key of the tile's first span (AttentionTile::window).
  if (window > 0) query_tile = static_cast<int>(std::min<int64_t>(query_tile, kKeySpan));
  const int64_t group = num_heads / num_kv_heads, width = requests.table_width;
  const int64_t *starts = requests.query_start, *lens = requests.context_lens, *table = requests.block_table;
  AttentionPlan plan;
  plan.num_heads = num_heads;
  plan.window = window;
  plan.softcap = softcap;
  bool all_decodes = true;
  std::vector<TileWork>& work = plan.work;
  std::vector<Split>& splits = plan.splits;
  int64_t &scratch_floats = plan.scratch_floats, &num_partial_floats = plan.num_partial_floats;
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
    all_decodes = all_decodes && num_queries == 1;
    PD_CHECK((lens[r] + block_size - 1) / block_size <= width, "block table too narrow for the context");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b) {
      PD_CHECK(table[r * width + b] >= 0 && table[r * width + b] < caches.num_blocks, "block id outside the cache");
    }
    // The first key a query at `position` sees: 0, or its window's first.
    const auto first_key = [&](int64_t position) { return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0; };
    // A decode's parts: 1 unless few_requests (parts_per_request is 1 then), or its keys are too few.
    const int64_t decode_begin = first_key(lens[r] - 1), decode_keys = lens[r] - decode_begin;
    const int64_t parts = num_queries == 1 ? std::min(parts_per_request, decode_keys / kMinSplitKeys) : 1;
    if (parts > 1) {
      // Where part p begins: the parts about even, each one after the first at a multiple of 16 keys, so that over
      // an int8 cache in groups (kv_types.h: Int8Groups) it reads no key of the part before and its spans are those
      // of a cache in rows (the same output, bit for bit); rows do not mind where a part begins. Each part keeps
      // more than kMinSplitKeys - 16 keys.
      const auto part_begins = [&](int64_t p) {
        if (p == 0) return decode_begin;
        if (p == parts) return lens[r];
        const int64_t even = decode_begin + decode_keys * p / parts;
        return even - even % Int8Groups::kSlots;
      };
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        splits.push_back({r, h, parts, num_partial_floats});
        for (int64_t part = 0; part < parts; ++part) {
          const int64_t begin = part_begins(part), end = part_begins(part + 1);
          work.push_back({r, 0, 1, h, 1, end - begin, begin, end, num_partial_floats});
          num_partial_floats += group * (head_dim + 2);
        }
      }
      scratch_floats = std::max(scratch_floats, attention_scratch_floats(1, 1, group, head_dim));
      continue;
    }
    for (int64_t first = 0; first < num_queries; first += query_tile) {
      const int64_t count = std::min<int64_t>(query_tile, num_queries - first);
      const int64_t key_begin = first_key(lens[r] - num_queries + first);
      const int64_t cost = count * (lens[r] - num_queries + first + count - key_begin);
      // A tile of few queries (a decode) takes several kv heads, up to the rows of a full query tile, so
      // that one thread reads each cache slot's heads together; a long one takes one kv head.
      const int64_t heads = few_requests ? 1 : std::clamp<int64_t>(query_tile / count, 1, kMaxTileKvHeads);
      for (int64_t h = 0; h < num_kv_heads; h += heads) {
        const int64_t tile_heads = std::min(heads, num_kv_heads - h);
        work.push_back({r, first, count, h, tile_heads, cost * tile_heads, key_begin});
        scratch_floats = std::max(scratch_floats, attention_scratch_floats(count, tile_heads, group, head_dim));
      }
    }
  }
  // Longest tiles first, so the dynamic schedule ends evenly.
  std::stable_sort(work.begin(), work.end(), [](const TileWork& a, const TileWork& b) { return a.cost > b.cost; });
  plan.fuses_rope = all_decodes && splits.empty();
  for (const TileWork& item : work) plan.fuses_rope = plan.fuses_rope && item.num_kv_heads == num_kv_heads;
  plan.block_size = block_size;
  plan.num_blocks = caches.num_blocks;
  plan.num_kv_heads = num_kv_heads;
  plan.head_dim = head_dim;
  return plan;
}

void paged_attention(const KernelSet& kernels, const AttentionPlan& plan, const float* query, const KvCaches& caches,
                     const StepRequests& requests, float* out, const DecodeRope* rope) {
  PD_CHECK(rope == nullptr || (plan.fuses_rope && rope->query == query),
           "only a decode step's attention, planned to fuse them, writes its tokens' query and keys");
  PD_CHECK(caches.num_blocks == plan.num_blocks && caches.block_size == plan.block_size &&
               caches.num_kv_heads == plan.num_kv_heads && caches.head_dim == plan.head_dim,
           "the caches are not the ones the attention was planned for");
  const int64_t num_heads = plan.num_heads, head_dim = caches.head_dim, group = num_heads / caches.num_kv_heads;
  std::vector<float> partials(plan.num_partial_floats);
  std::visit(
      [&](const auto& storage) {
        using Cache = std::remove_pointer_t<decltype(storage.key)>;
        attend(kernels.for_cache<Cache>().attend_tile, plan, query, storage, caches, requests, out, partials.data(),
               rope, caches_in_groups<Cache>(kernels, caches));
      },
      caches.storage);
  merge_splits(plan.splits, partials.data(), requests, num_heads, group, head_dim, out);
}

}  // namespace bs
