// The attention of a tile over an int8 cache in groups (kv_types.h: Int8Groups) on AVX512-VNNI (BS_INT8_DOT):
// KernelSet's attend_tile for such a cache. Each group holds 16 slots of one kv head laid out for vpdpbusd: a key
// vector of 64 bytes is 16 keys' dims 4m..4m + 3, so one vpdpbusd against a query row's 4 codes broadcast adds a
// part of 16 keys' scores (no horizontal sums, nothing regrouped); a value vector is 4 keys' codes of 16 dims, so one
// vpdpbusd against a row's 4 weights broadcast adds 4 keys' values (nothing interleaved); 16 scales are one load.
// The sums, the scores and the weights are score_rows_int8's and accumulate_values_int8's (attention_int8_dot.h) for
// the same rows, bit for bit; spans begin at a multiple of 16 keys, so that a tile that begins elsewhere (a split's
// part, a sliding window) hides the keys of its first group before its first key.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

#ifdef BS_INT8_DOT
// scores[r * kKeySpan + lane] for ROWS query rows (quantize_query_row's, head_dim floats apart from q) and the
// 16 keys of `group`.
template <int ROWS>
static inline void score_group_int8(const float* q, int64_t head_dim, const Int8* group, float* scores) {
  const __m512i flip = _mm512_set1_epi8(-128);
  __m512i acc[ROWS];
  const int32_t* words[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = _mm512_setzero_si512();
    words[r] = reinterpret_cast<const int32_t*>(q + r * head_dim);
  }
  for (int64_t m = 0; m < head_dim / 4; ++m) {
    const __m512i keys = _mm512_xor_si512(_mm512_loadu_si512(group + m * 64), flip);
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], keys, _mm512_set1_epi32(words[r][m]));
  }
  const Int8* scales = group + Int8Groups::scale(0, head_dim);
  const __m256i scale_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales));
  const __m512 key_scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(scale_bits), 16));
  for (int r = 0; r < ROWS; ++r) {
    const QueryRowCodes row = query_row_codes(q + r * head_dim, head_dim);
    const __m512i dots = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(row.bias));
    _mm512_storeu_ps(scores + r * kKeySpan,
                     _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(row.scale)), key_scale));
  }
}

// acc_r[first_dim..first_dim + 16 * VECTORS) += the values of num_keys keys (the span's groups: `groups`) weighted by
// ROWS rows' 8-bit weights (int8_value_weights): sums in int32 of VECTORS vectors of 16 dims, kept in registers.
// ahead() is called once per group (16 keys).
template <int ROWS, int VECTORS, class Ahead>
static inline void values_of_dims_int8(float* acc, const uint8_t (*weights)[kKeySpan], const float* unit,
                                       const Int8* const* groups, int64_t num_keys, int64_t head_dim,
                                       int64_t first_dim, Ahead& ahead) {
  __m512i sums[ROWS][VECTORS];
  for (int r = 0; r < ROWS; ++r)
    for (int n = 0; n < VECTORS; ++n) sums[r][n] = _mm512_setzero_si512();
  for (int64_t k = 0; k < (num_keys + 3) / 4; ++k) {
    if (k % 4 == 0) ahead();
    const Int8* codes = groups[k / 4] + Int8Groups::value_code(4 * (k % 4), first_dim, head_dim);
    __m512i v[VECTORS];
    for (int n = 0; n < VECTORS; ++n) v[n] = _mm512_loadu_si512(codes + n * 64);
    for (int r = 0; r < ROWS; ++r) {
      uint32_t word;
      __builtin_memcpy(&word, weights[r] + 4 * k, sizeof word);
      const __m512i w = _mm512_set1_epi32(static_cast<int32_t>(word));
      for (int n = 0; n < VECTORS; ++n) sums[r][n] = _mm512_dpbusd_epi32(sums[r][n], w, v[n]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m512 u = _mm512_set1_ps(unit[r]);
    float* out = acc + r * head_dim + first_dim;
    for (int n = 0; n < VECTORS; ++n) {
      _mm512_storeu_ps(out + 16 * n, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][n]), u, _mm512_loadu_ps(out + 16 * n)));
    }
  }
}

// acc_r += the values of num_keys keys (the span's groups) weighted by ROWS rows' 8-bit weights, 64 dims a pass
// (head_dim is a multiple of 16).
template <int ROWS, class Ahead>
static inline void values_groups_int8(float* acc, const uint8_t (*weights)[kKeySpan], const float* unit,
                                      const Int8* const* groups, int64_t num_keys, int64_t head_dim, Ahead& ahead) {
  int64_t d = 0;
  for (; d + 64 <= head_dim; d += 64) {
    values_of_dims_int8<ROWS, 4>(acc, weights, unit, groups, num_keys, head_dim, d, ahead);
  }
  const int64_t left = (head_dim - d) / 16;
  if (left == 3) values_of_dims_int8<ROWS, 3>(acc, weights, unit, groups, num_keys, head_dim, d, ahead);
  if (left == 2) values_of_dims_int8<ROWS, 2>(acc, weights, unit, groups, num_keys, head_dim, d, ahead);
  if (left == 1) values_of_dims_int8<ROWS, 1>(acc, weights, unit, groups, num_keys, head_dim, d, ahead);
}

// What a tile in groups asks for while it computes (TileAsks' pace for rows, attention_prefetch.h): its own groups
// after its first span, then the next tile's first span, a share at each call, so that both are asked for by the
// end of the tile at about the pace its keys are used (a decode's last span may hold a key or two: the next tile's
// keys are asked for over the whole tile, not that span alone).
struct GroupAsks {
  struct Part {
    const AttentionTile<Int8>* tile = nullptr;
    int64_t key = 0, end = 0;  // the next group's first key, and where the part's keys end
    int64_t block = 0, within = 0;  // key's block-table entry and slot in it (no division per group)
    Part() = default;
    Part(const AttentionTile<Int8>* of, int64_t from, int64_t to)
        : tile(of), key(from), end(to), block(from / of->block_size), within(from % of->block_size) {}
  };
  static constexpr int64_t kAll = INT64_MAX / 2;  // ask(kAll): everything left
  Part parts[2];
  int part = 0;
  const char *key = nullptr, *value = nullptr;  // the group (of every kv head of its tile) being asked for
  int64_t at = 0, bytes = 0, pace = 0;           // bytes of it asked for; its bytes; bytes per call

  // Keys [from, to) of t (from a multiple of 16); then, if `next`, the next tile's first span; in `calls` calls.
  GroupAsks(const AttentionTile<Int8>& t, int64_t from, int64_t to, const AttentionTile<Int8>* next, int64_t calls) {
    parts[0] = Part(&t, from, to);
    if (next != nullptr) {
      const int64_t first = next->key_begin - next->key_begin % Int8Groups::kSlots;
      parts[1] = Part(next, first, next->key_end - first < kKeySpan ? next->key_end : first + kKeySpan);
    }
    int64_t total = 0;
    for (const Part& p : parts) {
      if (p.tile == nullptr || p.key >= p.end) continue;
      const int64_t groups = (p.end - p.key + Int8Groups::kSlots - 1) / Int8Groups::kSlots;
      total += groups * p.tile->num_tile_kv_heads * Int8Groups::bytes(p.tile->head_dim);
    }
    pace = calls > 0 ? (total + calls - 1) / calls : total;
    pace = (pace + 63) / 64 * 64;
  }
  // Moves to the next group not yet asked for; false when there is none.
  inline bool next_group() {
    while (part < 2) {
      Part& p = parts[part];
      if (p.tile != nullptr && p.key < p.end) {
        const AttentionTile<Int8>& t = *p.tile;
        const int64_t slot = t.block_ids[p.block] * t.block_size + p.within;
        const int64_t group_bytes = Int8Groups::bytes(t.head_dim);
        const int64_t offset = Int8Groups::index(slot, t.kv_head, t.num_kv_heads) * group_bytes;
        key = reinterpret_cast<const char*>(t.key_cache + offset);
        value = reinterpret_cast<const char*>(t.value_cache + offset);
        bytes = t.num_tile_kv_heads * group_bytes, at = 0;
        p.key += Int8Groups::kSlots;
        p.within += Int8Groups::kSlots;
        if (p.within == t.block_size) p.within = 0, ++p.block;
        return true;
      }
      ++part;
    }
    return false;
  }
  // `amount` more bytes asked for.
  inline void ask(int64_t amount) {
    while (amount > 0) {
      if (at >= bytes && !next_group()) return;
      const int64_t stop = at + (amount < bytes - at ? amount : bytes - at);  // kept in registers, not in *this
      // The keys' lines, then the values' (rather than taking turns: the stage paired in one process 0.972-0.980
      // of the old order's time, keys and values alike).
      for (int64_t line = at; line < stop; line += 64) __builtin_prefetch(key + line, 0, 2);
      for (int64_t line = at; line < stop; line += 64) __builtin_prefetch(value + line, 0, 2);
      amount -= stop - at;
      at = stop;
    }
  }
  inline void operator()() { ask(pace); }
  // Everything of the tile's own keys before `key` (a span about to be scored) not yet asked for.
  inline void through(int64_t key_end) {
    while (part == 0 && (at < bytes || parts[0].key < key_end)) {
      if (at >= bytes && (!next_group() || part != 0)) return;  // none left of the tile's own
      ask(bytes - at);
    }
  }
};

// The rows [r, r + count) of a span's scores (visible[i] of row r + i from the span's first key `span`): capped
// (softcap), and the keys before a row's first hidden: the tile's first key (key_begin) and the row's window's. A
// row that sees none of the span's keys gets visible 0.
__attribute__((noinline, cold)) static void hide_group_keys(const AttentionTile<Int8>& t, int64_t r, int count,
                                                            int64_t span, int64_t* visible, float* scores) {
  const int64_t group = t.num_heads / t.num_kv_heads;
  for (int i = 0; i < count; ++i) {
    float* row = scores + (r + i) * kKeySpan;
    if (t.softcap > 0.0f) cap_scores(row, visible[i], t.softcap);
    int64_t first_key = t.key_begin;
    if (t.window > 0) {
      const int64_t window_begins = t.first_position + (r + i) / group - t.window + 1;
      first_key = window_begins > first_key ? window_begins : first_key;
    }
    const int64_t hidden = first_key - span;
    if (hidden >= visible[i]) {
      visible[i] = 0;
      continue;
    }
    for (int64_t j = 0; j < hidden; ++j) row[j] = -__builtin_inff();
  }
}

// Softmax and values of rows [r, r + ROWS) of one kv head for a span whose scores are in `scores`. Flattened: the
// rows' softmax_update, weights and sums inlined, so that the rows' chains overlap (int8 ns a tile, one thread,
// old/new taking turns: 681, 966 -> 596, 851 at 16 keys; 2474, 3420 -> 2223, 2994 at 144).
template <int ROWS, class Ahead>
__attribute__((flatten)) static inline void attend_group_rows(const AttentionTile<Int8>& t, const HeadRows& head,
                                                              int64_t r, int64_t span, int64_t span_keys,
                                                              const Int8* const* groups, float* scores, bool hides,
                                                              Ahead& ahead) {
  const int64_t dim = t.head_dim;
  int64_t visible[ROWS];
  visible_keys(t, r, ROWS, span, span_keys, visible);
  if (hides) hide_group_keys(t, r, ROWS, span, visible, scores);
  int64_t most_visible = 0;
  for (int i = 0; i < ROWS; ++i) most_visible = visible[i] > most_visible ? visible[i] : most_visible;
  for (int i = 0; i < ROWS; ++i) {
    softmax_update(scores + (r + i) * kKeySpan, visible[i], most_visible, head.running_max + r + i,
                   head.running_sum + r + i, head.acc + (r + i) * dim, dim);
  }
  if (most_visible == 0) return;
  alignas(64) float scales[kKeySpan];
  for (int64_t g = 0; g * Int8Groups::kSlots < most_visible; ++g) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(groups[g] + Int8Groups::scale(0, dim)));
    _mm512_store_ps(scales + g * 16, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
  const int64_t full = most_visible - most_visible % 16;
  for (int i = 0; i < ROWS; ++i) {
    float* row = scores + (r + i) * kKeySpan;
    for (int64_t j = 0; j < full; j += 16) {
      _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), _mm512_load_ps(scales + j)));
    }
    for (int64_t j = full; j < most_visible; ++j) row[j] *= scales[j];
  }
  alignas(64) uint8_t weights[ROWS][kKeySpan];
  float unit[ROWS];
  int8_value_weights<ROWS>(scores + r * kKeySpan, most_visible, weights, unit);
  values_groups_int8<ROWS>(head.acc + r * dim, weights, unit, groups, most_visible, dim, ahead);
}

// attend_tile for an int8 cache in groups: a span's groups scored for each kv head of the tile (every row, 4 at a
// time), then each row's softmax, and the values summed 4 rows at a time.
static void attend_tile_int8_groups(const AttentionTile<Int8>& t) {
  const int64_t group = t.num_heads / t.num_kv_heads, dim = t.head_dim;
  const int64_t rows = t.num_queries * group;  // per kv head: row qi * group + i = query qi, head group member i
  float* scores = t.scratch;                   // [num_tile_kv_heads, rows, kKeySpan]
  float* state = scores + t.num_tile_kv_heads * rows * kKeySpan;
  HeadRows heads[kMaxTileKvHeads];
  if (dim <= 128) {
    lay_out_rows_with(t, state, heads, [&](HeadRows&, const float* src, float* row, int64_t) {
      quantize_scaled_query(src, t.scale, row, dim);
    });
  } else {
    lay_out_head_rows(t, state, heads, [dim](HeadRows&, float* row, int64_t) { quantize_query_row(row, dim); });
  }

  const int64_t group_bytes = Int8Groups::bytes(dim);
  const int64_t first_span = t.key_begin - t.key_begin % Int8Groups::kSlots;
  const int64_t first_end = t.key_end - first_span < kKeySpan ? t.key_end : first_span + kKeySpan;
  if (!t.first_span_prefetched) {
    GroupAsks(t, first_span, first_end, nullptr, 0).ask(GroupAsks::kAll);
  }
  // Once per group and head scored, once per head's values of a span, and once per group, 64 dims and 4 rows summed
  // (asking while the values are summed too: the decode attention stage at 64 sequences of 128 keys, paired step
  // by step in one process against asking only while scoring, 0.906, 0.909 and 0.953 of its time).
  const int64_t all_groups = (t.key_end - first_span + Int8Groups::kSlots - 1) / Int8Groups::kSlots;
  const int64_t spans = (t.key_end - first_span + kKeySpan - 1) / kKeySpan;
  const int64_t value_calls = all_groups * ((dim + 63) / 64) * ((rows + 3) / 4);
  GroupAsks ahead(t, first_end, t.key_end, t.next, t.num_tile_kv_heads * (all_groups + spans + value_calls));
  const Int8* key_groups[kKeySpan / Int8Groups::kSlots];
  const Int8* value_groups[kKeySpan / Int8Groups::kSlots];
  for (int64_t span = first_span; span < t.key_end; span += kKeySpan) {
    const int64_t span_keys = t.key_end - span < kKeySpan ? t.key_end - span : kKeySpan;
    const int64_t num_groups = (span_keys + Int8Groups::kSlots - 1) / Int8Groups::kSlots;
    for (int64_t g = 0, block = span / t.block_size, within = span % t.block_size; g < num_groups; ++g) {
      const int64_t slot = t.block_ids[block] * t.block_size + within;
      const int64_t at = Int8Groups::index(slot, t.kv_head, t.num_kv_heads) * group_bytes;
      key_groups[g] = t.key_cache + at, value_groups[g] = t.value_cache + at;
      within += Int8Groups::kSlots;
      if (within == t.block_size) within = 0, ++block;  // no division per group
    }
    if (span > first_span) ahead.through(span + span_keys);  // what the asks left of this span
    // Queries before the span see none of it; a tile that begins inside its first group, a window and a cap
    // vary the scores.
    const int64_t first_row = (span > t.first_position ? span - t.first_position : 0) * group;
    const bool hides = (span < t.key_begin) || t.window > 0 || t.softcap > 0.0f;
    for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
      float* head_scores = scores + h * rows * kKeySpan;
      const float* q = heads[h].q;
      for (int64_t g = 0; g < num_groups; ++g) {
        ahead();
        const Int8* keys = key_groups[g] + h * group_bytes;
        float* at = head_scores + g * Int8Groups::kSlots;
        int64_t r = first_row;
        for (; r + 4 <= rows; r += 4) score_group_int8<4>(q + r * dim, dim, keys, at + r * kKeySpan);
        if (rows - r == 3) score_group_int8<3>(q + r * dim, dim, keys, at + r * kKeySpan);
        if (rows - r == 2) score_group_int8<2>(q + r * dim, dim, keys, at + r * kKeySpan);
        if (rows - r == 1) score_group_int8<1>(q + r * dim, dim, keys, at + r * kKeySpan);
      }
    }
    for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
      ahead();
      float* head_scores = scores + h * rows * kKeySpan;
      const Int8* values[kKeySpan / Int8Groups::kSlots];
      for (int64_t g = 0; g < num_groups; ++g) values[g] = value_groups[g] + h * group_bytes;
      int64_t r = first_row;
      for (; r + 4 <= rows; r += 4) {
        attend_group_rows<4>(t, heads[h], r, span, span_keys, values, head_scores, hides, ahead);
      }
      if (rows - r == 3) attend_group_rows<3>(t, heads[h], r, span, span_keys, values, head_scores, hides, ahead);
      if (rows - r == 2) attend_group_rows<2>(t, heads[h], r, span, span_keys, values, head_scores, hides, ahead);
      if (rows - r == 1) attend_group_rows<1>(t, heads[h], r, span, span_keys, values, head_scores, hides, ahead);
    }
  }
  ahead.ask(GroupAsks::kAll);  // what the calls did not ask for (a tile of fewer keys than counted)
  store_head_rows(t, heads, [dim](const float* acc, float scale, float* dst) { store_scaled(acc, scale, dim, dst); });
}

// One row x [head_dim] encoded as KvElement<Int8>::store_scaled_row encodes it (its scale, then each code: x times
// the scale's inverse, within +-127, rounded to nearest even), placed at slot `lane` of its group as a key's codes
// (4-byte words 64 bytes apart) or a value's (a byte every 4: vpmovzxbd's dword lanes, shifted to the slot's byte,
// stored under a byte mask).
static inline void place_int8_row(const float* x, Int8* group, int64_t lane, int64_t head_dim, bool is_key) {
  // write_scale writes a row's scale after its head_dim codes: here the slot's scale in the group.
  Int8* scale_at = group + Int8Groups::scale(lane, head_dim);
  const float to_code = ScaledRow::write_scale(scale_at - head_dim, head_dim, ScaledRow::largest(x, head_dim), 127.0f);
  const __m512 factor = _mm512_set1_ps(to_code), top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
  const __mmask64 byte_of_slot = 0x1111111111111111ull << (lane % 4);
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(x + d), factor);
    const __m512i codes = _mm512_cvtps_epi32(_mm512_max_ps(bottom, _mm512_min_ps(top, scaled)));
    if (is_key) {
      alignas(16) int8_t bytes[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(bytes), _mm512_cvtsepi32_epi8(codes));
      for (int m = 0; m < 4; ++m) __builtin_memcpy(group + Int8Groups::key_code(lane, d + 4 * m), bytes + 4 * m, 4);
    } else {
      const __m512i placed = _mm512_slli_epi32(_mm512_and_si512(codes, _mm512_set1_epi32(0xff)), 8 * (lane % 4));
      _mm512_mask_storeu_epi8(group + Int8Groups::value_code(lane - lane % 4, d, head_dim), byte_of_slot, placed);
    }
  }
}

// KernelSet's write_int8_groups: a token's K (rotated: rotate_head_to's fp32 rotation) and V of every kv head
// encoded and placed in their groups (kv_types.h: Int8Groups), the codes and scales the rows' bit for bit.
static void write_int8_groups(const float* key, const float* value, const float* cos, const float* sin, int64_t slot,
                              Int8* k_cache, Int8* v_cache, int64_t num_kv_heads, int64_t head_dim) {
  float rotated[kMaxScaledHeadDim];
  const int64_t lane = slot % Int8Groups::kSlots, bytes = Int8Groups::bytes(head_dim);
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const int64_t group = Int8Groups::index(slot, h, num_kv_heads) * bytes;
    rotate_head_to<float>(key + h * head_dim, cos, sin, rotated, head_dim);
    place_int8_row(rotated, k_cache + group, lane, head_dim, true);
    place_int8_row(value + h * head_dim, v_cache + group, lane, head_dim, false);
  }
}
#else
static void attend_tile_int8_groups(const AttentionTile<Int8>& t);
#endif
