// The attention of one tile (AttentionTile: a request's queries at consecutive positions for one or more kv heads)
// over its keys in the paged KV cache, span by span: KernelSet's attend_tile.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

// scores[(r + i) * kKeySpan + j] = the scores of ROWS rows (from row r) of one kv head for num_keys keys (a
// multiple of 4); kDot: the rows' queries are bf16 words (score_rows_dot, a cache DotCache reads); kInt8Dot<Cache>:
// int8 codes and their scale (score_rows_int8); else floats.
template <int ROWS, bool kDot, class Cache, class Ahead>
static inline void score_head_rows(const HeadRows& head, int64_t r, int64_t dim, const Cache* const* keys,
                                   int64_t num_keys, float* scores, Ahead& ahead) {
  if constexpr (kDot) {
    score_rows_dot<ROWS>(reinterpret_cast<const uint32_t*>(head.q) + r * dim / 2, dim, keys, num_keys,
                         scores + r * kKeySpan, ahead);
  } else if constexpr (kInt8Dot<Cache>) {
    score_rows_int8<ROWS>(head.q + r * dim, dim, keys, num_keys, scores + r * kKeySpan, ahead);
  } else {
    score_rows<ROWS>(head.q + r * dim, dim, keys, num_keys, scores + r * kKeySpan, ahead);
  }
}

// A scaled cache's scores (or probabilities) of rows [first_row, rows) for a span's keys times each key's row scale()
// (of `of`: the keys' rows, or the values') and `factor`: each scale read once for all rows.
template <class Cache>
static inline void scale_by_rows(const Cache* const* of, int64_t num_keys, int64_t dim, float factor,
                                 int64_t first_row, int64_t rows, float* scores) {
  alignas(64) float scales[kKeySpan];
  row_scales(of, num_keys, dim, factor, scales);
  times_row_scales(scales, num_keys, first_row, rows, scores);
}

// Softmax and values of one span for ROWS consecutive rows (from row r) of one kv head, and their scores
// unless by_slot (score_span_by_slot scored them) or `scored` (score_span_in_lanes did). Values: with kDot &&
// by_slot, values_span_by_slot sums them; other by_slot tiles ask while summing, one-head tiles (prefills, long
// contexts) only while scoring. A scaled cache's value_scales: the span's values' scales (row_scales, times kWeight
// with kDot), read once per span and kv head for all its rows.
template <int ROWS, bool kDot, bool by_slot, class Cache, class Ahead>
static inline void attend_rows(const AttentionTile<Cache>& t, const HeadRows& head, int64_t r, int64_t span,
                               int64_t span_keys, int64_t padded_keys, const Cache* const* keys,
                               const Cache* const* values, const float* value_scales, float* scores, Ahead& ahead,
                               bool scored = false, const Bf16* const* value_words = nullptr) {
  const int64_t dim = t.head_dim;
  if constexpr (!by_slot) {
    if (!scored) {
      score_head_rows<ROWS, kDot>(head, r, dim, keys, padded_keys, scores, ahead);
      if constexpr (kDot && KvElement<Cache>::kScaled) {
        scale_by_rows(keys, span_keys, dim, 1.0f / DotCache<Cache>::kQuery, r, r + ROWS, scores);
      }
    }
  }
  int64_t visible[ROWS];
  const int64_t most_visible = visible_keys(t, r, ROWS, span, span_keys, visible);
  if (__builtin_expect(t.window > 0 || t.softcap > 0.0f, 0)) vary_scores(t, r, ROWS, span, visible, scores);
  for (int i = 0; i < ROWS; ++i) {
    softmax_update(scores + (r + i) * kKeySpan, visible[i], most_visible, head.running_max + r + i,
                   head.running_sum + r + i, head.acc + (r + i) * dim, dim);
  }
  if constexpr (!(kDot && by_slot)) {
    NoAsks no_asks;
    auto& value_asks = [&]() -> auto& {
      if constexpr (by_slot) {
        return ahead;
      } else {
        return no_asks;
      }
    }();
    if constexpr (KvElement<Cache>::kScaled) times_row_scales(value_scales, most_visible, r, r + ROWS, scores);
    if constexpr (kDot && KvElement<Cache>::kScaled) {
      if (value_words != nullptr) {  // a prompt's span, its values decoded once (rows_as_words)
        accumulate_values_dot<ROWS>(head.acc + r * dim, scores + r * kKeySpan, value_words, most_visible, dim,
                                    value_asks);
      } else {
        accumulate_values_dot<ROWS>(head.acc + r * dim, scores + r * kKeySpan, values, most_visible, dim, value_asks);
      }
    } else if constexpr (kDot) {
      accumulate_values_dot<ROWS>(head.acc + r * dim, scores + r * kKeySpan, values, most_visible, dim, value_asks);
    } else if constexpr (kInt8Dot<Cache>) {
      accumulate_values_int8<ROWS>(head.acc + r * dim, scores + r * kKeySpan, values, most_visible, dim, value_asks);
    } else {
      accumulate_values<ROWS>(head.acc + r * dim, scores + r * kKeySpan, values, most_visible, dim, value_asks);
    }
  }
}

// The scores of a span for every kv head of the tile (head h's rows at scores + h * rows * kKeySpan), a group
// of 4 keys at a time for all heads: slot_offsets[j] (j < padded_keys) locates key j's first head.
template <bool kDot, class Cache, class Ahead>
static inline void score_span_by_slot(const AttentionTile<Cache>& t, const HeadRows* heads,
                                      const int64_t* slot_offsets, int64_t padded_keys, int64_t first_row,
                                      int64_t rows, float* scores, Ahead& ahead) {
  const int64_t dim = t.head_dim;
  for (int64_t j = 0; j < padded_keys; j += 4) {
    for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
      const Cache* keys[4];
      for (int c = 0; c < 4; ++c) keys[c] = t.key_cache + slot_offsets[j + c] + h * kv_row_elements<Cache>(dim);
      float* head_scores = scores + h * rows * kKeySpan + j;
      int64_t r = first_row;
      for (; r + 3 <= rows; r += 3) score_head_rows<3, kDot>(heads[h], r, dim, keys, 4, head_scores, ahead);
      if (rows - r == 2) score_head_rows<2, kDot>(heads[h], r, dim, keys, 4, head_scores, ahead);
      if (rows - r == 1) score_head_rows<1, kDot>(heads[h], r, dim, keys, 4, head_scores, ahead);
    }
  }
}

#ifdef BS_BF16_DOT
template <int ROWS, class Cache, class Ahead>
static inline void values_of_heads(int64_t num_heads, float* const* accs, const float* const* probs,
                                   const Cache* head_values, const int64_t* slot_offsets, int64_t num_keys,
                                   int64_t head_dim, int64_t row, Ahead& ahead) {
  if (num_heads == 3) {
    accumulate_values_by_slot<ROWS, 3>(accs, probs, head_values, slot_offsets, num_keys, head_dim, row, ahead);
  }
  if (num_heads == 2) {
    accumulate_values_by_slot<ROWS, 2>(accs, probs, head_values, slot_offsets, num_keys, head_dim, row, ahead);
  }
  if (num_heads == 1) {
    accumulate_values_by_slot<ROWS, 1>(accs, probs, head_values, slot_offsets, num_keys, head_dim, row, ahead);
  }
}

// The values of a span (its probabilities in `scores`, as score_span_by_slot lays them out) for every kv head
// of the tile, 3 rows of 3 heads at a time: each pair of keys' heads read together. A scaled cache's probabilities
// are folded with the value rows' scale() * kWeight first (in place: the scores are not read again).
template <class Cache, class Ahead>
static inline void values_span_by_slot(const AttentionTile<Cache>& t, const HeadRows* heads,
                                       const int64_t* slot_offsets, int64_t span, int64_t span_keys,
                                       int64_t first_row, int64_t rows, float* scores, Ahead& ahead) {
  const int64_t dim = t.head_dim, row = kv_row_elements<Cache>(dim);
  if constexpr (KvElement<Cache>::kScaled) {
    for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
      const Cache* values[kKeySpan];
      for (int64_t j = 0; j < span_keys; ++j) values[j] = t.value_cache + slot_offsets[j] + h * row;
      scale_by_rows(values, span_keys, dim, DotCache<Cache>::kWeight, first_row, rows, scores + h * rows * kKeySpan);
    }
  }
  for (int64_t r = first_row; r < rows; r += 3) {
    const int count = rows - r < 3 ? static_cast<int>(rows - r) : 3;
    int64_t visible[3];
    const int64_t num_keys = visible_keys(t, r, count, span, span_keys, visible);
    for (int64_t h0 = 0; h0 < t.num_tile_kv_heads; h0 += 3) {
      const int64_t num_heads = t.num_tile_kv_heads - h0 < 3 ? t.num_tile_kv_heads - h0 : 3;
      float* accs[3];
      const float* probs[3];
      for (int64_t i = 0; i < num_heads; ++i) {
        accs[i] = heads[h0 + i].acc + r * dim;
        probs[i] = scores + (h0 + i) * rows * kKeySpan + r * kKeySpan;
      }
      const Cache* head_values = t.value_cache + h0 * row;
      if (count == 3) values_of_heads<3>(num_heads, accs, probs, head_values, slot_offsets, num_keys, dim, row, ahead);
      if (count == 2) values_of_heads<2>(num_heads, accs, probs, head_values, slot_offsets, num_keys, dim, row, ahead);
      if (count == 1) values_of_heads<1>(num_heads, accs, probs, head_values, slot_offsets, num_keys, dim, row, ahead);
    }
  }
}
#else
template <class Cache, class Ahead>
void values_span_by_slot(const AttentionTile<Cache>& t, const HeadRows* heads, const int64_t* slot_offsets,
                         int64_t span, int64_t span_keys, int64_t first_row, int64_t rows, float* scores,
                         Ahead& ahead);
#endif

// Attention of a tile's queries for its kv heads [kv_head, kv_head + num_tile_kv_heads). The keys of
// one span are scattered over the cache (one row per slot and head): each span's slots are asked for
// while the span before computes (TileAsks), every head of the tile at once, so that misses are in flight
// while the arithmetic runs, and each slot's heads are read while they are in cache. A tile's first span is
// asked for while the thread's tile before it computes (t.next of that one): a decode tile's keys then
// arrive while the previous decode computes, instead of between two tiles.
// A tile of several kv heads (a decode's) also asks while it sums values, and goes through each span
// slot by slot: each group of 4 keys is scored for every head, and (kDot) each pair of keys' values summed
// for 3 heads at once, so that a slot's heads, adjacent in the cache, are read together.
// kDot (a bf16 or fp8 e4m3 cache with AVX512-BF16, head_dim a multiple of 32: DotCache; fp8's prefill spans stay
// off the AMX tiles): keys scored by score_rows_dot, values summed
// by accumulate_values_dot (accumulate_values_by_slot); a one-head tile of several queries (a prefill's) rewrites
// each span's keys in lanes once and scores all its rows from them (score_span_in_lanes: no horizontal sums;
// prefill 1x512, 30 layers, paired in one process: 0.80x the time of scoring 3 rows at a time by score_rows_dot,
// and summing the values 6 rows at a time instead of 3 measured no faster, 0.82x).
// kInt8Dot (an int8 cache in rows with AVX512-VNNI, blocks of other than a multiple of 16 tokens; in groups the
// tile is attend_tile_int8_groups'): keys scored by score_rows_int8 (vpdpbusd on the query's codes), a
// prefill's from each span's keys regrouped once (score_rows_int8_grouped: no horizontal sums; prefill 1x512 on a
// Zen 4, int8 / bf16 1.31-1.41 -> 1.00-1.08), values summed on 8-bit weights by accumulate_values_int8.
// by_slot: the tile has several kv heads (an instance of its own, so that the one-head tiles' code stays as
// it was).
template <class Cache, bool kDot, bool by_slot>
static void attend_tile_with(const AttentionTile<Cache>& t) {
  const int64_t group = t.num_heads / t.num_kv_heads, dim = t.head_dim;
  const int64_t rows = t.num_queries * group;  // per kv head: row qi * group + i = query qi, head group member i
  float* scores = t.scratch;  // [num_tile_kv_heads, rows, kKeySpan]; without by_slot, [rows, kKeySpan] reused by each head
  float* state = scores + t.num_tile_kv_heads * rows * kKeySpan;
  // [head_dim / 2, kKeySpan]: a prefill span's keys in lanes (keys_in_lanes)
  uint32_t* keys_by_lane = reinterpret_cast<uint32_t*>(state + t.num_tile_kv_heads * rows * (2 * dim + 2));
  HeadRows heads[kMaxTileKvHeads];
  lay_out_head_rows(t, state, heads, [dim](HeadRows& head, float* row, int64_t r) {
    // In place: row r's words end before row r + 1's floats begin.
    if constexpr (kDot) {
      if constexpr (DotCache<Cache>::kQuery != 1.0f) {  // exact: a power of two
        const reg factor = Vec::set1(DotCache<Cache>::kQuery);
        for (int64_t d = 0; d < dim; d += W) Vec::store(row + d, Vec::mul(Vec::load(row + d), factor));
      }
      to_bf16_pairs(row, dim, reinterpret_cast<uint32_t*>(head.q) + r * dim / 2);
    }
    if constexpr (kInt8Dot<Cache>) quantize_query_row(row, dim);  // in place, rows still dim floats apart
  });

  const int64_t row = kv_row_elements<Cache>(dim);  // elements from one row of the cache to the next
  int64_t slot_offsets[kKeySpan];  // elements from the cache's start to the slot's first kv head of the tile
  const Cache* keys[kKeySpan];
  const Cache* values[kKeySpan];
  const int64_t num_keys = t.key_end - t.key_begin;
  // About how many times this tile calls ahead() (per group of 4 keys: once scoring, and with by_slot once per
  // value pass): its later spans and the next tile's first span are spread over them.
  const int64_t row_groups = (rows + 2) / 3;
  const int64_t value_passes = kDot ? dim / 32 : dim / (kValueChunk<3> * W);
  const int64_t value_heads = kDot && by_slot ? (t.num_tile_kv_heads + 2) / 3 : t.num_tile_kv_heads;
  const int64_t num_asks =
      row_groups * ((num_keys + 3) / 4) * (t.num_tile_kv_heads + (by_slot ? value_heads * value_passes : 0));
  TileAsks<Cache> ahead(t, num_asks);
  for (int64_t span = t.key_begin; span < t.key_end; span += kKeySpan) {
    const int64_t span_keys = t.key_end - span < kKeySpan ? t.key_end - span : kKeySpan;
    for (int64_t j = 0, block = span / t.block_size, within = span % t.block_size; j < span_keys; ++j) {
      slot_offsets[j] = ((t.block_ids[block] * t.block_size + within) * t.num_kv_heads + t.kv_head) * row;
      if (++within == t.block_size) within = 0, ++block;  // no division per key
    }
    ahead.span_begins(t, span);  // what was not asked for while the span (or tile) before computed
    const int64_t padded_keys = (span_keys + 3) / 4 * 4;  // extra keys repeat one; their scores are never read
    // Queries before the span see none of it.
    const int64_t first_row = (span > t.first_position ? span - t.first_position : 0) * group;
    if constexpr (by_slot) {
      for (int64_t j = span_keys; j < padded_keys; ++j) slot_offsets[j] = slot_offsets[0];
      score_span_by_slot<kDot>(t, heads, slot_offsets, padded_keys, first_row, rows, scores, ahead);
      if constexpr (kDot && KvElement<Cache>::kScaled) {  // the codes' products summed: times the keys' scales
        for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
          for (int64_t j = 0; j < span_keys; ++j) keys[j] = t.key_cache + slot_offsets[j] + h * row;
          scale_by_rows(keys, span_keys, dim, 1.0f / DotCache<Cache>::kQuery, first_row, rows,
                        scores + h * rows * kKeySpan);
        }
      }
    }
    for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
      float* head_scores = by_slot ? scores + h * rows * kKeySpan : scores;
      if constexpr (!by_slot) {  // a by_slot tile's keys were scored by score_span_by_slot
        for (int64_t j = 0; j < span_keys; ++j) keys[j] = t.key_cache + slot_offsets[j] + h * row;
        for (int64_t j = span_keys; j < padded_keys; ++j) keys[j] = keys[0];
      }
      alignas(64) float value_scales[kKeySpan];
      if constexpr (!(kDot && by_slot)) {  // kDot && by_slot: values_span_by_slot sums the values
        for (int64_t j = 0; j < span_keys; ++j) values[j] = t.value_cache + slot_offsets[j] + h * row;
        if constexpr (KvElement<Cache>::kScaled) {
          row_scales(values, span_keys, dim, kDot ? DotCache<Cache>::kWeight : 1.0f, value_scales);
        }
      }
      bool scored = false;  // every row's scores of the span computed at once, keys in lanes
      const Bf16* value_words[kKeySpan];  // a scaled cache's values of the span as bf16 words (rows_as_words)
      const Bf16* const* decoded = nullptr;  // value_words once they hold the span
      if constexpr (kDot && !by_slot) {
        if (t.num_queries > 1) {  // a decode's 3 rows would not pay for rewriting the keys
          const int64_t lane_keys = (span_keys + 15) / 16 * 16;
          for (int64_t j = padded_keys; j < lane_keys; ++j) keys[j] = keys[0];
          keys_in_lanes(keys, lane_keys, dim, keys_by_lane);
#ifdef BS_AMX_ATTENTION  // a bf16 cache's scores, softmax and values of the span on AMX tiles (attention_amx.h)
          if constexpr (__is_same(Cache, Bf16)) {
            attend_span_on_tiles(t, heads[h], span, span_keys, first_row, rows, lane_keys, values, keys_by_lane,
                                 head_scores, ahead);
            continue;
          }
#endif
          alignas(64) float key_scales[kKeySpan];  // a scaled cache's: its codes' products times the keys' scales
          if constexpr (KvElement<Cache>::kScaled) {
            row_scales(keys, lane_keys, dim, 1.0f / DotCache<Cache>::kQuery, key_scales);
          }
          score_span_in_lanes(reinterpret_cast<const uint32_t*>(heads[h].q), first_row, rows, dim, keys_by_lane,
                              lane_keys, head_scores, ahead, KvElement<Cache>::kScaled ? key_scales : nullptr);
          if constexpr (KvElement<Cache>::kScaled) {
            // The keys in lanes are read: their place holds the values decoded once for all the rows (prefill
            // 1x512 on a Zen 4, fp8 / bf16 attention paired by round: 1.088, 1.118 against 1.209, 1.193 decoding
            // them for each 3 rows).
            Bf16* words = reinterpret_cast<Bf16*>(keys_by_lane);
            rows_as_words(values, span_keys, dim, words);
            for (int64_t j = 0; j < span_keys; ++j) value_words[j] = words + j * dim;
            decoded = value_words;
          }
          scored = true;
        }
      }
      if constexpr (kInt8Dot<Cache> && !by_slot) {
        if (t.num_queries > 1 && dim >= 32 && dim <= kMaxGroupedDim) {  // a prompt's rows share the regrouped keys
          const int64_t grouped = (span_keys + 15) / 16 * 16;  // fits keys_by_lane from head_dim 32
          for (int64_t j = padded_keys; j < grouped; ++j) keys[j] = keys[0];
          alignas(64) float key_scales[kKeySpan];
          for (int64_t j = 0; j < grouped; ++j) key_scales[j] = KvElement<Cache>::scale(keys[j], dim);
          __m512i* groups = reinterpret_cast<__m512i*>(keys_by_lane);
          int8_key_groups(keys, grouped, dim, groups);
          const float* q = heads[h].q;
          int64_t r = first_row;
          for (; r + 3 <= rows; r += 3) {
            score_rows_int8_grouped<3>(q + r * dim, dim, groups, key_scales, grouped, head_scores + r * kKeySpan, ahead);
          }
          if (rows - r == 2) {
            score_rows_int8_grouped<2>(q + r * dim, dim, groups, key_scales, grouped, head_scores + r * kKeySpan, ahead);
          }
          if (rows - r == 1) {
            score_rows_int8_grouped<1>(q + r * dim, dim, groups, key_scales, grouped, head_scores + r * kKeySpan, ahead);
          }
          scored = true;
        }
      }
      int64_t r = first_row;
      for (; r + 3 <= rows; r += 3) {
        attend_rows<3, kDot, by_slot>(t, heads[h], r, span, span_keys, padded_keys, keys, values, value_scales,
                                      head_scores, ahead, scored, decoded);
      }
      if (rows - r == 2) {
        attend_rows<2, kDot, by_slot>(t, heads[h], r, span, span_keys, padded_keys, keys, values, value_scales,
                                      head_scores, ahead, scored, decoded);
      }
      if (rows - r == 1) {
        attend_rows<1, kDot, by_slot>(t, heads[h], r, span, span_keys, padded_keys, keys, values, value_scales,
                                      head_scores, ahead, scored, decoded);
      }
    }
    if constexpr (kDot && by_slot) {
      values_span_by_slot(t, heads, slot_offsets, span, span_keys, first_row, rows, scores, ahead);
    }
  }
  ahead.all();  // what the groups did not ask for (a tile of fewer keys than counted)
  store_head_rows(t, heads, [dim](const float* acc, float scale, float* dst) {
    if constexpr (kDot) {
      store_unpermuted(acc, scale / DotCache<Cache>::kWeight, dim, dst);
    } else {
      store_scaled(acc, scale, dim, dst);
    }
  });
}

template <class Cache, bool kDot = false>
static void attend_tile_of(const AttentionTile<Cache>& t) {
  if (t.num_tile_kv_heads > 1) return attend_tile_with<Cache, kDot, true>(t);
  attend_tile_with<Cache, kDot, false>(t);
}

// KernelSet's attend_tile for a cache of element type T: by vdpbf16ps where the kernel set has it (BS_BF16_DOT), the
// elements are bf16 or fp8 e4m3 (DotCache) and head_dim a multiple of 32.
// An int8 cache in groups (kv_types.h: Int8Groups, the kernel sets with AVX512-VNNI): attend_tile_int8_groups.
template <class T>
static void attend_tile(const AttentionTile<T>& tile) {
  if constexpr (kInt8Dot<T>) {
    if (tile.int8_groups) return attend_tile_int8_groups(tile);
  }
#ifdef BS_BF16_DOT
  if constexpr (DotCache<T>::kReads) {
    if (tile.head_dim % 32 == 0) return attend_tile_of<T, true>(tile);
  }
#endif
  attend_tile_of<T, false>(tile);
}
