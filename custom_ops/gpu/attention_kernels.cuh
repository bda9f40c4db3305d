// Paged attention straight from the block table: decodes and chunked-prefill segments in one
// launch, grouped-query heads, causal by absolute position, optionally within a sliding window
// (a query at position p sees keys max(0, p - W + 1)..p) and with soft-capped scores
// (s -> c * tanh(s / c), Gemma 2's).
//
// Work: a request's queries are cut into tiles of `query_tile` consecutive queries; one block
// attends one tile for one kv head (all of the head's query heads: `group` rows per query) over
// one split of the keys. A long context is cut into splits of `split_keys` keys (split-K), so a
// few long sequences still fill the GPU; each split leaves a partial result (normalized output,
// running max and sum) that combine_splits_kernel merges. With one split the block writes the
// output itself. The grid is (tokens, kv heads, splits): the block of token t works only if t is
// the first token of its tile, so the grid is known from shapes alone and the host never reads
// the step's lengths back from the device.
//
// With a window a tile reads only the keys its queries see (from its first query's window start
// to its last query) and its splits cut those keys alone: a decode of 4000 keys with a window of
// 512 reads 512 keys, split as 512 keys would be. Keys inside that span but outside one query's
// window (a prefill tile's later queries) are read and masked.
//
// Inside a block, keys come in tiles of 32, read from their cache blocks into shared memory as
// float; a warp scores one query row against the tile (a key per lane) and updates that row's
// online softmax, then every thread accumulates probabilities x values for its output elements.
//
// An 8-bit cache (kv_rows.cuh) is read as its codes' values and each row's scale: a key's score is
// q . codes times its row's scale, and a value's scale is folded into its probability (the softmax's
// sum takes the probability alone).
#pragma once

#include "kv_rows.cuh"

namespace bs::gpu {

constexpr int kAttentionThreads = 128;
constexpr int kAttentionWarps = kAttentionThreads / kWarpSize;
constexpr int kTileKeys = kWarpSize;  // one key per lane when scoring
constexpr int kMaxRows = 32;          // query rows of one block: queries x heads of the group
constexpr int kMaxHeadDim = 256;
constexpr int kUnitsPerThread = kMaxRows * kMaxHeadDim / 4 / kAttentionThreads;  // 4 outputs per unit
constexpr int64_t kMinSplitKeys = 256;  // a split shorter than this costs more to merge than it saves
constexpr int kBlocksPerSm = 8;         // blocks the split choice aims for per multiprocessor

// What the host knows of a step without reading device memory.
struct AttentionShape {
  int64_t num_tokens, num_requests, table_width;
  int num_heads, num_kv_heads, head_dim, block_size;
  int64_t sliding_window;  // keys a query sees, itself included; 0: every key before it
};

struct AttentionPlan {
  int query_tile;            // queries per tile
  int64_t split_keys;        // keys per split
  int64_t max_splits;        // splits of the longest possible context (table_width * block_size)
  int64_t workspace_floats;  // partial results; 0 when nothing is split
  size_t shared_bytes;
};

BS_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// null if the kernels can attend this shape, else why not.
inline const char* attention_shape_problem(const AttentionShape& s) {
  if (s.num_heads <= 0 || s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0) {
    return "num_heads must be a positive multiple of num_kv_heads";
  }
  if (s.num_heads / s.num_kv_heads > kMaxRows) return "more than 32 query heads share a kv head";
  if (s.head_dim <= 0 || s.head_dim % 8 != 0 || s.head_dim > kMaxHeadDim) {
    return "head_dim must be a multiple of 8 up to 256";
  }
  if (s.block_size <= 0 || s.num_tokens < 0 || s.num_requests <= 0 || s.table_width <= 0) {
    return "empty block table or negative sizes";
  }
  if (s.num_tokens > 0 && s.num_tokens < s.num_requests) return "fewer tokens than requests";
  if (s.sliding_window < 0) return "sliding_window must be 0 (none) or positive";
  return nullptr;
}

// null if the kernels can soft-cap scores at `softcap`, else why not.
inline const char* softcap_problem(float softcap) {
  return softcap >= 0.0f && softcap < INFINITY ? nullptr : "softcap must be 0 (none) or positive and finite";
}

// Deterministic in the shape, so the op, the combine step and the tests agree on it.
inline AttentionPlan plan_attention(const AttentionShape& s, int requested_query_tile, int num_sms) {
  const int group = s.num_heads / s.num_kv_heads;
  // Every request has a query, so no request has more than tokens - requests + 1 of them.
  const int64_t longest_query = std::max<int64_t>(1, s.num_tokens - s.num_requests + 1);
  const int query_tile = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({requested_query_tile, kMaxRows / group, longest_query})));
  const int64_t max_context = s.table_width * s.block_size;
  // The most keys one tile reads: a window's keys and the keys of its tile's later queries.
  const int64_t max_keys =
      s.sliding_window > 0 ? std::min(max_context, s.sliding_window + query_tile - 1) : max_context;
  const int64_t tiles = std::max<int64_t>(1, std::min(s.num_tokens, s.num_requests + s.num_tokens / query_tile));
  const int64_t wanted = ceil_div(static_cast<int64_t>(kBlocksPerSm) * std::max(num_sms, 1), tiles * s.num_kv_heads);
  const int64_t splits = std::max<int64_t>(1, std::min(wanted, max_keys / kMinSplitKeys));
  const int64_t split_keys = ceil_div(ceil_div(max_keys, splits), kTileKeys) * kTileKeys;
  const int64_t max_splits = ceil_div(max_keys, split_keys);
  const int64_t rows = static_cast<int64_t>(query_tile) * group, dim = s.head_dim;
  const int64_t shared_floats = rows * dim                // queries
                                + kTileKeys * (dim + 4)   // keys (rows padded: no bank conflicts)
                                + kTileKeys * dim         // values
                                + rows * kTileKeys        // probabilities
                                + 3 * ceil_div(rows, 4) * 4  // running max, sum, correction
                                + 2 * kTileKeys           // the keys' cache offsets (int64)
                                + 2 * kTileKeys;          // the keys' and values' row scales (8-bit caches)
  return {query_tile, split_keys, max_splits,
          max_splits > 1 ? s.num_tokens * s.num_heads * max_splits * (dim + 2) : 0,
          static_cast<size_t>(shared_floats) * sizeof(float)};
}

// The query tile that token `token` belongs to.
struct QueryTile {
  int64_t request, first_token, num_queries;
  int64_t first_position;  // absolute position of the tile's first query
  int64_t key_begin;       // the first key its first query sees: 0, or its window's start
  int64_t key_end;         // keys the tile's last query sees: first_position + num_queries
};

// The request holding flat token `token`: the largest r with query_start[r] <= token.
BS_HOST_DEVICE inline int64_t request_of_token(const int64_t* query_start, int64_t num_requests, int64_t token) {
  int64_t low = 0, high = num_requests - 1;
  while (low < high) {
    const int64_t middle = (low + high + 1) / 2;
    if (query_start[middle] <= token) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  return low;
}

BS_HOST_DEVICE inline QueryTile query_tile_of(int64_t token, const int64_t* query_start, const int64_t* context_lens,
                                              int64_t num_requests, int query_tile, int64_t sliding_window) {
  const int64_t request = request_of_token(query_start, num_requests, token);
  const int64_t num_queries = query_start[request + 1] - query_start[request];
  const int64_t local = token - query_start[request];
  const int64_t first_local = local - local % query_tile;
  QueryTile tile;
  tile.request = request;
  tile.first_token = query_start[request] + first_local;
  tile.num_queries = num_queries - first_local < query_tile ? num_queries - first_local : query_tile;
  tile.first_position = context_lens[request] - num_queries + first_local;
  const int64_t window_start = tile.first_position - sliding_window + 1;
  tile.key_begin = sliding_window > 0 && window_start > 0 ? window_start : 0;
  tile.key_end = tile.first_position + tile.num_queries;
  return tile;
}

BS_HOST_DEVICE inline int64_t num_splits_of(const QueryTile& tile, int64_t split_keys) {
  return ceil_div(tile.key_end - tile.key_begin, split_keys);
}

// Whether the query at `position` sees the key at `key`: causal, and inside the window if there is one.
BS_HOST_DEVICE inline bool key_visible(int64_t key, int64_t position, int64_t sliding_window) {
  return key <= position && (sliding_window == 0 || key > position - sliding_window);
}

template <class T, class Cache = T>
struct PagedAttentionParams {
  using Element = T;
  using CacheElement = Cache;
  const T* query;               // [tokens, num_heads, head_dim]
  const Cache* key_cache;       // [num_blocks, block_size, num_kv_heads, kv_row_elements<Cache>(head_dim)]
  const Cache* value_cache;     // same
  const int64_t* query_start;   // [requests + 1]: request r's queries are rows query_start[r]..query_start[r + 1]
  const int64_t* context_lens;  // [requests]: its tokens in the cache, this step's included
  const int64_t* block_table;   // [requests, table_width]
  T* out;                       // [tokens, num_heads * head_dim]
  float* workspace;             // plan.workspace_floats
  AttentionShape shape;
  AttentionPlan plan;
  float scale;    // of q.k, folded into the queries
  float softcap;  // scores become softcap * tanh(score / softcap); 0: none
};

// Partial results of split-K, indexed (token, head, split).
struct SplitParts {
  float* outputs;  // [parts, head_dim], normalized by their own sum
  float* maxima;   // [parts]
  float* sums;     // [parts]
};

BS_HOST_DEVICE inline SplitParts split_parts(float* workspace, const AttentionShape& s, const AttentionPlan& plan) {
  const int64_t parts = s.num_tokens * s.num_heads * plan.max_splits;
  return {workspace, workspace + parts * s.head_dim, workspace + parts * (s.head_dim + 1)};
}

BS_DEVICE float dot(const float* a, const float* b, int dim) {
  float sum = 0.0f;
  for (int d = 0; d < dim; d += 4) {
    const float4 x = *reinterpret_cast<const float4*>(a + d), y = *reinterpret_cast<const float4*>(b + d);
    sum += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
  }
  return sum;
}

template <class P>
__global__ void __launch_bounds__(kAttentionThreads) paged_attention_kernel(const P p) {
  using T = typename P::Element;
  using Cache = typename P::CacheElement;
  constexpr bool kScaled = KvRow<Cache>::kScaled;
  const AttentionShape& s = p.shape;
  const int64_t token = blockIdx.x;
  const QueryTile tile =
      query_tile_of(token, p.query_start, p.context_lens, s.num_requests, p.plan.query_tile, s.sliding_window);
  const int64_t split = blockIdx.z, key_begin = tile.key_begin + split * p.plan.split_keys;
  if (tile.first_token != token || key_begin >= tile.key_end) return;  // the whole block: no work here
  const int64_t key_stop = min_i64(tile.key_end, key_begin + p.plan.split_keys);
  const int kv_head = blockIdx.y, group = s.num_heads / s.num_kv_heads, dim = s.head_dim;
  const int rows = static_cast<int>(tile.num_queries) * group;  // row r: query r / group, head kv_head * group + r % group
  const int plan_rows = p.plan.query_tile * group;
  const int tid = threadIdx.x, lane = lane_id(), warp = warp_id();

  BS_DYNAMIC_SHARED(shared);
  float* queries = reinterpret_cast<float*>(shared);
  float* keys = queries + plan_rows * dim;
  float* values = keys + kTileKeys * (dim + 4);
  float* probs = values + kTileKeys * dim;
  float* running_max = probs + plan_rows * kTileKeys;
  const int stats = static_cast<int>(ceil_div(plan_rows, 4) * 4);
  float* running_sum = running_max + stats;
  float* correction = running_sum + stats;
  int64_t* key_offsets = reinterpret_cast<int64_t*>(correction + stats);
  float* key_scales = reinterpret_cast<float*>(key_offsets + kTileKeys);
  float* value_scales = key_scales + kTileKeys;

  for (int e = tid; e < rows * dim; e += kAttentionThreads) {
    const int r = e / dim, head = kv_head * group + r % group;
    const int64_t source = ((tile.first_token + r / group) * s.num_heads + head) * dim + e % dim;
    queries[e] = to_float(p.query[source]) * p.scale;
  }
  for (int r = tid; r < rows; r += kAttentionThreads) running_max[r] = -INFINITY, running_sum[r] = 0.0f;
  const int units = rows * dim / 4;  // unit u: row u / (dim / 4), outputs 4 * (u % (dim / 4)) .. + 4
  float acc[kUnitsPerThread][4] = {};
  __syncthreads();

  const int chunk = Chunk<Cache>::kElements, chunks_per_key = dim / chunk;
  const int64_t row_elements = kv_row_elements<Cache>(dim);
  const int64_t* table_row = p.block_table + tile.request * s.table_width;
  for (int64_t tile_start = key_begin; tile_start < key_stop; tile_start += kTileKeys) {
    const int num_keys = static_cast<int>(min_i64(kTileKeys, key_stop - tile_start));
    if (tid < num_keys) {
      const int64_t position = tile_start + tid;
      const int64_t slot = table_row[position / s.block_size] * s.block_size + position % s.block_size;
      key_offsets[tid] = (slot * s.num_kv_heads + kv_head) * row_elements;
    }
    if constexpr (kScaled) {
      if (tid < kTileKeys) {  // keys past the tile's end weigh nothing
        key_scales[tid] = tid < num_keys ? row_scale(p.key_cache + key_offsets[tid], dim) : 0.0f;
        value_scales[tid] = tid < num_keys ? row_scale(p.value_cache + key_offsets[tid], dim) : 0.0f;
      }
    }
    __syncthreads();
    for (int c = tid; c < num_keys * chunks_per_key; c += kAttentionThreads) {
      const int j = c / chunks_per_key, first = (c % chunks_per_key) * chunk;
      float key[Chunk<Cache>::kElements], value[Chunk<Cache>::kElements];
      load_chunk(p.key_cache + key_offsets[j] + first, key);
      load_chunk(p.value_cache + key_offsets[j] + first, value);
      for (int i = 0; i < chunk; i += 4) {  // 16-byte stores: rows and chunks start at multiples of 4 floats
        *reinterpret_cast<float4*>(keys + j * (dim + 4) + first + i) = float4{key[i], key[i + 1], key[i + 2], key[i + 3]};
        *reinterpret_cast<float4*>(values + j * dim + first + i) =
            float4{value[i], value[i + 1], value[i + 2], value[i + 3]};
      }
    }
    __syncthreads();
    // Warp w scores rows w, w + 4, ... against the tile (lane j: key j) and updates their softmax.
    for (int first_row = 0; first_row < rows; first_row += kAttentionWarps) {
      const int r = first_row + warp;
      float score = -INFINITY;
      const int64_t position = tile.first_position + r / group;
      if (r < rows && lane < num_keys && key_visible(tile_start + lane, position, s.sliding_window)) {
        score = dot(queries + r * dim, keys + lane * (dim + 4), dim);
        if constexpr (kScaled) score *= key_scales[lane];
        if (p.softcap > 0.0f) score = p.softcap * tanhf(score / p.softcap);
      }
      const float old_max = r < rows ? running_max[r] : -INFINITY;
      const float new_max = fmaxf(old_max, warp_max(score));
      const float prob = score == -INFINITY ? 0.0f : expf(score - new_max);
      const float tile_sum = warp_sum(prob);
      if (r < rows) {
        if constexpr (kScaled) {
          probs[r * kTileKeys + lane] = prob * value_scales[lane];
        } else {
          probs[r * kTileKeys + lane] = prob;
        }
        if (lane == 0) {
          const float scale_old = old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
          correction[r] = scale_old;
          running_sum[r] = running_sum[r] * scale_old + tile_sum;
          running_max[r] = new_max;
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kUnitsPerThread; ++u) {
      const int unit = tid + u * kAttentionThreads;
      if (unit < units) {
        const int r = unit / (dim / 4), d = unit % (dim / 4) * 4;
        float sum[4] = {};
        for (int j = 0; j < num_keys; ++j) {
          const float prob = probs[r * kTileKeys + j];
          const float4 v = *reinterpret_cast<const float4*>(values + j * dim + d);
          sum[0] += prob * v.x, sum[1] += prob * v.y, sum[2] += prob * v.z, sum[3] += prob * v.w;
        }
        for (int k = 0; k < 4; ++k) acc[u][k] = acc[u][k] * correction[r] + sum[k];
      }
    }
    // The next tile's first barrier comes before anything this pass reads is overwritten.
  }

  const bool split_up = num_splits_of(tile, p.plan.split_keys) > 1;
  const SplitParts parts = split_parts(p.workspace, s, p.plan);
#pragma unroll
  for (int u = 0; u < kUnitsPerThread; ++u) {
    const int unit = tid + u * kAttentionThreads;
    if (unit < units) {
      const int r = unit / (dim / 4), d = unit % (dim / 4) * 4;
      const int64_t row_token = tile.first_token + r / group, head = kv_head * group + r % group;
      const float total = running_sum[r];
      if (!split_up) {
        for (int k = 0; k < 4; ++k) p.out[(row_token * s.num_heads + head) * dim + d + k] = from_float<T>(acc[u][k] / total);
      } else {
        const int64_t part = (row_token * s.num_heads + head) * p.plan.max_splits + split;
        for (int k = 0; k < 4; ++k) parts.outputs[part * dim + d + k] = total > 0.0f ? acc[u][k] / total : 0.0f;
        if (d == 0) parts.maxima[part] = running_max[r], parts.sums[part] = total;
      }
    }
  }
}

// Merges the splits of every (token, head) whose tile was split: weights sum_s * exp(max_s - max).
template <class P>
__global__ void __launch_bounds__(kAttentionThreads) combine_splits_kernel(const P p) {
  using T = typename P::Element;
  const AttentionShape& s = p.shape;
  const int64_t token = blockIdx.x, head = blockIdx.y;
  const QueryTile tile =
      query_tile_of(token, p.query_start, p.context_lens, s.num_requests, p.plan.query_tile, s.sliding_window);
  const int64_t splits = num_splits_of(tile, p.plan.split_keys);
  if (splits == 1) return;
  const SplitParts parts = split_parts(p.workspace, s, p.plan);
  const int64_t first_part = (token * s.num_heads + head) * p.plan.max_splits;
  float top = -INFINITY;
  for (int64_t i = 0; i < splits; ++i) top = fmaxf(top, parts.maxima[first_part + i]);
  float total = 0.0f;
  for (int64_t i = 0; i < splits; ++i) {
    const float m = parts.maxima[first_part + i];
    total += m == -INFINITY ? 0.0f : parts.sums[first_part + i] * expf(m - top);
  }
  for (int d = threadIdx.x; d < s.head_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int64_t i = 0; i < splits; ++i) {
      const float m = parts.maxima[first_part + i];
      if (m != -INFINITY) sum += parts.sums[first_part + i] * expf(m - top) * parts.outputs[(first_part + i) * s.head_dim + d];
    }
    p.out[(token * s.num_heads + head) * s.head_dim + d] = from_float<T>(sum / total);
  }
}

// p.plan must be plan_attention(p.shape, ...) and p.workspace hold p.plan.workspace_floats.
template <class P>
Status launch_paged_attention(const P& p, Stream stream) {
  if (attention_shape_problem(p.shape) != nullptr || softcap_problem(p.softcap) != nullptr) return kInvalidArgument;
  if (p.shape.num_tokens == 0) return kSuccess;
  if (p.plan.workspace_floats > 0 && p.workspace == nullptr) return kInvalidArgument;
  Status status = allow_shared_memory(paged_attention_kernel<P>, p.plan.shared_bytes);
  if (status != kSuccess) return status;
  const dim3 grid(static_cast<unsigned>(p.shape.num_tokens), static_cast<unsigned>(p.shape.num_kv_heads),
                  static_cast<unsigned>(p.plan.max_splits));
  BS_LAUNCH(paged_attention_kernel<P>, grid, dim3(kAttentionThreads), p.plan.shared_bytes, stream, p);
  status = launch_status();
  if (status != kSuccess || p.plan.max_splits == 1) return status;
  const dim3 combine_grid(static_cast<unsigned>(p.shape.num_tokens), static_cast<unsigned>(p.shape.num_heads));
  BS_LAUNCH(combine_splits_kernel<P>, combine_grid, dim3(kAttentionThreads), 0, stream, p);
  return launch_status();
}

}  // namespace bs::gpu
