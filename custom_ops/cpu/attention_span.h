// The attention's arithmetic over one span of keys for a few query rows of one kv head: their scores, the online
// softmax and the sums of values (any cache element type), and the state a tile keeps per kv head.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

// scores[r * kKeySpan + j] = q_r . k_j for ROWS query rows and num_keys (a multiple of 4) keys;
// ahead() is called once per group of 4 keys (it asks for the cache lines of work to come).
template <int ROWS, class Cache, class Ahead>
static inline void score_rows(const float* q, int64_t head_dim, const Cache* const* keys, int64_t num_keys,
                              float* scores, Ahead& ahead) {
  for (int64_t j = 0; j < num_keys; j += 4) {
    ahead();
    reg acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = Vec::zero();
    for (int64_t d = 0; d < head_dim; d += W) {
      reg qv[ROWS];
      for (int r = 0; r < ROWS; ++r) qv[r] = Vec::load(q + r * head_dim + d);
      for (int c = 0; c < 4; ++c) {
        reg k = KvElement<Cache>::load(keys[j + c] + d);
        for (int r = 0; r < ROWS; ++r) acc[r][c] = Vec::fmadd(qv[r], k, acc[r][c]);
      }
    }
    for (int r = 0; r < ROWS; ++r) Vec::hsum4_store(acc[r][0], acc[r][1], acc[r][2], acc[r][3], scores + r * kKeySpan + j);
    if constexpr (KvElement<Cache>::kScaled) {  // each key's codes were summed: times its row's scale
      for (int c = 0; c < 4; ++c) {
        const float scale = KvElement<Cache>::scale(keys[j + c], head_dim);
        for (int r = 0; r < ROWS; ++r) scores[r * kKeySpan + j + c] *= scale;
      }
    }
  }
}

// scales[j] = the scale of a scaled cache's row of[j] (a key's or a value's) times `factor`, for j < num_keys.
template <class Cache>
static inline void row_scales(const Cache* const* of, int64_t num_keys, int64_t head_dim, float factor, float* scales) {
  for (int64_t j = 0; j < num_keys; ++j) scales[j] = KvElement<Cache>::scale(of[j], head_dim) * factor;
}

// Rows [first_row, rows) of a span's scores or probabilities (kKeySpan apart) times scales[j], for j < num_keys: a
// scaled cache's scores (its codes' products summed) times its keys' scales, or its probabilities times its values'
// scales, so that they weigh its loaded codes.
static inline void times_row_scales(const float* scales, int64_t num_keys, int64_t first_row, int64_t rows,
                                    float* scores) {
  const int64_t full = num_keys - num_keys % W;
  for (int64_t r = first_row; r < rows; ++r) {
    float* row = scores + r * kKeySpan;
    for (int64_t j = 0; j < full; j += W) Vec::store(row + j, Vec::mul(Vec::load(row + j), Vec::load(scales + j)));
    for (int64_t j = full; j < num_keys; ++j) row[j] *= scales[j];
  }
}

// acc_r[0..head_dim) += sum_j probs_r[j] * values[j] for ROWS rows at once: each value vector is loaded
// once for all rows (a scaled cache's probabilities folded with its value scales first: times_row_scales).
// CHUNK vectors of the head per pass keep ROWS * CHUNK accumulators in registers.
// ahead() is called once per 4 keys of a pass.
template <int ROWS>
constexpr int kValueChunk = W == 16 ? 4 : ROWS == 1 ? 4 : 2;
template <int ROWS, class Cache, class Ahead>
static inline void accumulate_values(float* acc, const float* probs, const Cache* const* values, int64_t num_keys,
                                     int64_t head_dim, Ahead& ahead) {
  constexpr int CHUNK = kValueChunk<ROWS>;
  int64_t d = 0;
  for (; d + CHUNK * W <= head_dim; d += CHUNK * W) {
    reg a[ROWS][CHUNK];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < CHUNK; ++c) a[r][c] = Vec::load(acc + r * head_dim + d + c * W);
    for (int64_t j = 0; j < num_keys; ++j) {
      if (j % 4 == 0) ahead();
      reg v[CHUNK];
      for (int c = 0; c < CHUNK; ++c) v[c] = KvElement<Cache>::load(values[j] + d + c * W);
      for (int r = 0; r < ROWS; ++r) {
        const reg p = Vec::set1(probs[r * kKeySpan + j]);
        for (int c = 0; c < CHUNK; ++c) a[r][c] = Vec::fmadd(p, v[c], a[r][c]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < CHUNK; ++c) Vec::store(acc + r * head_dim + d + c * W, a[r][c]);
  }
  for (; d < head_dim; d += W) {
    for (int r = 0; r < ROWS; ++r) {
      reg a = Vec::load(acc + r * head_dim + d);
      for (int64_t j = 0; j < num_keys; ++j) {
        a = Vec::fmadd(Vec::set1(probs[r * kKeySpan + j]), KvElement<Cache>::load(values[j] + d), a);
      }
      Vec::store(acc + r * head_dim + d, a);
    }
  }
}

// row[0..visible) = softcap * tanh(row / softcap).
static inline void cap_scores(float* row, int64_t visible, float softcap) {
  const float inverse = 1.0f / softcap;
  for (int64_t j = 0; j < visible; ++j) row[j] = softcap * __builtin_tanhf(row[j] * inverse);
}

// A tile's variations on rows r..r + count of a span's scores, before their softmax: each visible score capped
// (softcap * tanh(score / softcap)), and the span's keys before a row's window hidden (-inf). A row's window
// starts in the tile's first span (AttentionTile::window), so each row keeps a visible key there.
// Out of line and cold: most models vary nothing, and their tiles' loops keep the code they had without it (inlined,
// it cost prefill attention ~5%: SmolLM2 1x512, 69 -> 73 ms).
template <class Cache>
__attribute__((noinline, cold)) static void vary_scores(const AttentionTile<Cache>& t, int64_t r, int count,
                                                        int64_t span, const int64_t* visible, float* scores) {
  const int64_t group = t.num_heads / t.num_kv_heads;
  for (int i = 0; i < count; ++i) {
    float* row = scores + (r + i) * kKeySpan;
    if (t.softcap > 0.0f) cap_scores(row, visible[i], t.softcap);
    if (t.window > 0) {
      const int64_t hidden = t.first_position + (r + i) / group - t.window + 1 - span;
      for (int64_t j = 0; j < hidden && j < visible[i]; ++j) row[j] = -__builtin_inff();
    }
  }
}

// One online-softmax update of row `scores[0..visible)`: scores become probabilities (zero from `visible`
// to `padded`), the running max, sum and the row's accumulator are rescaled when the max grows. A row's last
// partial vector is computed whole (scores has room: a row is kKeySpan floats) with its lanes from `visible`
// masked, so that a causal diagonal's rows do not take up to W - 1 scalar exps each.
static_assert(kKeySpan % W == 0, "a row of scores is whole vectors");
static inline void softmax_update(float* scores, int64_t visible, int64_t padded, float* running_max,
                                  float* running_sum, float* acc, int64_t head_dim) {
  const int64_t full = visible - visible % W;
  const int tail = static_cast<int>(visible - full);
  float new_max = *running_max;
  if (visible > 0) {
    const reg lowest = Vec::set1(-__builtin_inff());
    reg maxes = lowest;
    for (int64_t j = 0; j < full; j += W) maxes = Vec::max(maxes, Vec::load(scores + j));
    if (tail > 0) maxes = Vec::max(maxes, Vec::first_lanes(Vec::load(scores + full), tail, lowest));
    const float vector_max = Vec::reduce_max(maxes);
    new_max = vector_max > new_max ? vector_max : new_max;
  }
  const reg shift = Vec::set1(new_max);
  reg sums = Vec::zero();
  for (int64_t j = 0; j < full; j += W) {
    reg p = vexp(Vec::sub(Vec::load(scores + j), shift));
    Vec::store(scores + j, p);
    sums = Vec::add(sums, p);
  }
  int64_t zero_from = full;
  if (tail > 0) {
    reg p = Vec::first_lanes(vexp(Vec::sub(Vec::load(scores + full), shift)), tail, Vec::zero());
    Vec::store(scores + full, p);
    sums = Vec::add(sums, p);
    zero_from = full + W;
  }
  const float sum = Vec::reduce_add(sums);
  for (int64_t j = zero_from; j < padded; ++j) scores[j] = 0.0f;
  if (new_max > *running_max) {
    const float correction = sexp(*running_max - new_max);  // 0 on the first span (max = -inf)
    const reg c = Vec::set1(correction);
    for (int64_t d = 0; d < head_dim; d += W) Vec::store(acc + d, Vec::mul(Vec::load(acc + d), c));
    *running_sum *= correction;
    *running_max = new_max;
  }
  *running_sum += sum;
}

// An ahead() that asks for nothing.
struct NoAsks {
  inline void operator()() {}
};

// One kv head's rows of a tile: its queries (scaled), accumulators and running softmax state.
struct HeadRows {
  float* q;             // [rows, dim]; with kDot [rows, dim / 2] bf16 words
  float* acc;           // [rows, dim]
  float* running_max;   // [rows]
  float* running_sum;   // [rows]
};

// A tile's kv heads' rows laid out in `state` (per head: rows queries, rows accumulators, each row's max and sum):
// each row's query written by write_row(head, src, row, r) from its floats in t.query (src) to row r (row), the
// accumulators zero and the softmax state empty.
template <class Cache, class WriteRow>
static inline void lay_out_rows_with(const AttentionTile<Cache>& t, float* state, HeadRows* heads,
                                     WriteRow&& write_row) {
  const int64_t group = t.num_heads / t.num_kv_heads, dim = t.head_dim, rows = t.num_queries * group;
  for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
    HeadRows& head = heads[h];
    head.q = state + h * rows * (2 * dim + 2);
    head.acc = head.q + rows * dim;
    head.running_max = head.acc + rows * dim;
    head.running_sum = head.running_max + rows;
    const int64_t kv_head = t.kv_head + h;
    for (int64_t qi = 0; qi < t.num_queries; ++qi) {
      for (int64_t i = 0; i < group; ++i) {
        const float* src = t.query + ((t.first_token + qi) * t.num_heads + kv_head * group + i) * dim;
        write_row(head, src, head.q + (qi * group + i) * dim, qi * group + i);
      }
    }
    for (int64_t i = 0; i < rows * dim; i += W) Vec::store(head.acc + i, Vec::zero());
    for (int64_t r = 0; r < rows; ++r) head.running_max[r] = -__builtin_inff(), head.running_sum[r] = 0.0f;
  }
}

// lay_out_rows_with, each row's query scaled by t.scale, then prepared in place by prepare(head, row, r) (row r's
// floats: rounded to bf16 pairs, quantized to int8, or left).
template <class Cache, class Prepare>
static inline void lay_out_head_rows(const AttentionTile<Cache>& t, float* state, HeadRows* heads, Prepare&& prepare) {
  const int64_t dim = t.head_dim;
  lay_out_rows_with(t, state, heads, [&](HeadRows& head, const float* src, float* row, int64_t r) {
    for (int64_t d = 0; d < dim; d += W) Vec::store(row + d, Vec::mul(Vec::load(src + d), Vec::set1(t.scale)));
    prepare(head, row, r);
  });
}

// A tile's results, row by row: store(acc, scale, dst) writes a row's sums times scale to dst: the output, scaled by
// 1 / the row's softmax sum, or (a split) the partial results, as they are, with the row's max and sum after them.
template <class Cache, class Store>
static inline void store_head_rows(const AttentionTile<Cache>& t, const HeadRows* heads, Store&& store) {
  const int64_t group = t.num_heads / t.num_kv_heads, dim = t.head_dim, rows = t.num_queries * group;
  for (int64_t h = 0; h < t.num_tile_kv_heads; ++h) {
    for (int64_t qi = 0; qi < t.num_queries; ++qi) {
      for (int64_t i = 0; i < group; ++i) {
        const int64_t r = qi * group + i;
        float* dst = t.out + (t.first_token + qi) * t.num_heads * dim + ((t.kv_head + h) * group + i) * dim;
        float scale = 1.0f / heads[h].running_sum[r];
        if (t.partial != nullptr) {  // a split: the sums as they are, and the softmax state to merge them by
          dst = t.partial + (h * rows + r) * (dim + 2);
          dst[dim] = heads[h].running_max[r], dst[dim + 1] = heads[h].running_sum[r];
          scale = 1.0f;
        }
        store(heads[h].acc + r * dim, scale, dst);
      }
    }
  }
}

// A row's sums times scale, as they are laid out.
static inline void store_scaled(const float* acc, float scale, int64_t dim, float* dst) {
  const reg inv = Vec::set1(scale);
  for (int64_t d = 0; d < dim; d += W) Vec::store(dst + d, Vec::mul(Vec::load(acc + d), inv));
}

// How many of a span's keys rows r..r + count of a tile see: each row's (visible[i]), and the most.
template <class Cache>
static inline int64_t visible_keys(const AttentionTile<Cache>& t, int64_t r, int count, int64_t span,
                                   int64_t span_keys, int64_t* visible) {
  const int64_t group = t.num_heads / t.num_kv_heads;
  int64_t most_visible = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t position = t.first_position + (r + i) / group;
    visible[i] = position - span + 1 < span_keys ? position - span + 1 : span_keys;
    most_visible = visible[i] > most_visible ? visible[i] : most_visible;
  }
  return most_visible;
}
