// The kernels, written once over `Vec` (simd_avx2.h or simd_avx512.h). Included by
// kernels_avx2.cc and kernels_avx512.cc inside their `#pragma GCC target` regions and
// namespaces; no include guard on purpose. Only builtins and own code here: an inline
// library function instantiated in this region would be compiled for the region's ISA.

using reg = Vec::reg;
constexpr int W = Vec::W;

// Cephes-style expf: |relative error| ~ 2e-7 on [-88, 88]; large negative inputs give 0.
static inline reg vexp(reg x) {
  x = Vec::min(Vec::max(x, Vec::set1(-88.3762626647949f)), Vec::set1(88.3762626647949f));
  reg n = Vec::floor(Vec::fmadd(x, Vec::set1(1.44269504088896341f), Vec::set1(0.5f)));
  x = Vec::fmadd(n, Vec::set1(-0.693359375f), x);
  x = Vec::fmadd(n, Vec::set1(2.12194440e-4f), x);
  reg y = Vec::set1(1.9875691500e-4f);
  y = Vec::fmadd(y, x, Vec::set1(1.3981999507e-3f));
  y = Vec::fmadd(y, x, Vec::set1(8.3334519073e-3f));
  y = Vec::fmadd(y, x, Vec::set1(4.1665795894e-2f));
  y = Vec::fmadd(y, x, Vec::set1(1.6666665459e-1f));
  y = Vec::fmadd(y, x, Vec::set1(5.0000001201e-1f));
  y = Vec::add(Vec::fmadd(y, Vec::mul(x, x), x), Vec::set1(1.0f));
  return Vec::mul(y, Vec::pow2(n));
}

static inline float sexp(float x) { return __builtin_expf(x); }

static void rms_norm_row(const float* x, const float* residual, const float* weight, float* out, float* summed,
                         int64_t width, float eps) {
  const int64_t full = width - width % W;
  reg squares = Vec::zero();
  float tail_squares = 0.0f;
  const float* source = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < full; i += W) {
      reg v = Vec::add(Vec::load(x + i), Vec::load(residual + i));
      Vec::store(summed + i, v);
      squares = Vec::fmadd(v, v, squares);
    }
    for (int64_t i = full; i < width; ++i) {
      summed[i] = x[i] + residual[i];
      tail_squares += summed[i] * summed[i];
    }
    source = summed;
  } else {
    for (int64_t i = 0; i < full; i += W) squares = Vec::fmadd(Vec::load(x + i), Vec::load(x + i), squares);
    for (int64_t i = full; i < width; ++i) tail_squares += x[i] * x[i];
  }
  const float mean = (Vec::reduce_add(squares) + tail_squares) / static_cast<float>(width);
  const float inv_rms = 1.0f / __builtin_sqrtf(mean + eps);
  const reg inv = Vec::set1(inv_rms);
  for (int64_t i = 0; i < full; i += W) {
    Vec::store(out + i, Vec::mul(Vec::mul(Vec::load(source + i), inv), Vec::load(weight + i)));
  }
  for (int64_t i = full; i < width; ++i) out[i] = source[i] * inv_rms * weight[i];
}

static void silu_and_mul_row(const float* gate_up, float* out, int64_t width) {
  const int64_t full = width - width % W;
  const reg one = Vec::set1(1.0f);
  for (int64_t i = 0; i < full; i += W) {
    reg gate = Vec::load(gate_up + i);
    reg silu = Vec::div(gate, Vec::add(one, vexp(Vec::sub(Vec::zero(), gate))));
    Vec::store(out + i, Vec::mul(silu, Vec::load(gate_up + width + i)));
  }
  for (int64_t i = full; i < width; ++i) {
    const float gate = gate_up[i];
    out[i] = gate / (1.0f + sexp(-gate)) * gate_up[width + i];
  }
}

static void rotate_head(const float* x, const float* cos, const float* sin, float* out, int64_t head_dim) {
  const int64_t half = head_dim / 2, full = half - half % W;
  for (int64_t i = 0; i < full; i += W) {
    reg x1 = Vec::load(x + i), x2 = Vec::load(x + half + i), c = Vec::load(cos + i), s = Vec::load(sin + i);
    Vec::store(out + i, Vec::sub(Vec::mul(x1, c), Vec::mul(x2, s)));
    Vec::store(out + half + i, Vec::fmadd(x1, s, Vec::mul(x2, c)));
  }
  for (int64_t i = full; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    out[i] = x1 * cos[i] - x2 * sin[i];
    out[half + i] = x2 * cos[i] + x1 * sin[i];
  }
}

// scores[r * kKeySpan + j] = q_r . k_j for ROWS query rows and num_keys (a multiple of 4) keys.
template <int ROWS>
static inline void score_rows(const float* q, int64_t head_dim, const float* const* keys, int64_t num_keys,
                              float* scores) {
  for (int64_t j = 0; j < num_keys; j += 4) {
    reg acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = Vec::zero();
    for (int64_t d = 0; d < head_dim; d += W) {
      reg qv[ROWS];
      for (int r = 0; r < ROWS; ++r) qv[r] = Vec::load(q + r * head_dim + d);
      for (int c = 0; c < 4; ++c) {
        reg k = Vec::load(keys[j + c] + d);
        for (int r = 0; r < ROWS; ++r) acc[r][c] = Vec::fmadd(qv[r], k, acc[r][c]);
      }
    }
    for (int r = 0; r < ROWS; ++r) Vec::hsum4_store(acc[r][0], acc[r][1], acc[r][2], acc[r][3], scores + r * kKeySpan + j);
  }
}

// acc[0..head_dim) += sum_j probs[j] * values[j]
static inline void accumulate_values(float* acc, const float* probs, const float* const* values, int64_t num_keys,
                                     int64_t head_dim) {
  int64_t d = 0;
  for (; d + 4 * W <= head_dim; d += 4 * W) {
    reg a0 = Vec::load(acc + d), a1 = Vec::load(acc + d + W), a2 = Vec::load(acc + d + 2 * W),
        a3 = Vec::load(acc + d + 3 * W);
    for (int64_t j = 0; j < num_keys; ++j) {
      const reg p = Vec::set1(probs[j]);
      const float* v = values[j] + d;
      a0 = Vec::fmadd(p, Vec::load(v), a0);
      a1 = Vec::fmadd(p, Vec::load(v + W), a1);
      a2 = Vec::fmadd(p, Vec::load(v + 2 * W), a2);
      a3 = Vec::fmadd(p, Vec::load(v + 3 * W), a3);
    }
    Vec::store(acc + d, a0);
    Vec::store(acc + d + W, a1);
    Vec::store(acc + d + 2 * W, a2);
    Vec::store(acc + d + 3 * W, a3);
  }
  for (; d < head_dim; d += W) {
    reg a = Vec::load(acc + d);
    for (int64_t j = 0; j < num_keys; ++j) a = Vec::fmadd(Vec::set1(probs[j]), Vec::load(values[j] + d), a);
    Vec::store(acc + d, a);
  }
}

// One online-softmax update of row `scores[0..visible)`: scores become probabilities, the running max,
// sum and the row's accumulator are rescaled when the max grows.
static inline void softmax_update(float* scores, int64_t visible, float* running_max, float* running_sum, float* acc,
                                  int64_t head_dim) {
  const int64_t full = visible - visible % W;
  float new_max = *running_max;
  if (full > 0) {
    reg maxes = Vec::load(scores);
    for (int64_t j = W; j < full; j += W) maxes = Vec::max(maxes, Vec::load(scores + j));
    const float vector_max = Vec::reduce_max(maxes);
    new_max = vector_max > new_max ? vector_max : new_max;
  }
  for (int64_t j = full; j < visible; ++j) new_max = scores[j] > new_max ? scores[j] : new_max;
  const reg shift = Vec::set1(new_max);
  reg sums = Vec::zero();
  for (int64_t j = 0; j < full; j += W) {
    reg p = vexp(Vec::sub(Vec::load(scores + j), shift));
    Vec::store(scores + j, p);
    sums = Vec::add(sums, p);
  }
  float sum = Vec::reduce_add(sums);
  for (int64_t j = full; j < visible; ++j) {
    scores[j] = sexp(scores[j] - new_max);
    sum += scores[j];
  }
  if (new_max > *running_max) {
    const float correction = sexp(*running_max - new_max);  // 0 on the first span (max = -inf)
    const reg c = Vec::set1(correction);
    for (int64_t d = 0; d < head_dim; d += W) Vec::store(acc + d, Vec::mul(Vec::load(acc + d), c));
    *running_sum *= correction;
    *running_max = new_max;
  }
  *running_sum += sum;
}

static void attend_tile(const AttentionTile& t) {
  const int64_t group = t.num_heads / t.num_kv_heads, dim = t.head_dim;
  const int64_t rows = t.num_queries * group;  // row qi * group + i: query qi, head kv_head * group + i
  float* q = t.scratch;
  float* acc = q + rows * dim;
  float* scores = acc + rows * dim;
  float* running_max = scores + rows * kKeySpan;
  float* running_sum = running_max + rows;
  const reg scale = Vec::set1(t.scale);
  for (int64_t qi = 0; qi < t.num_queries; ++qi) {
    for (int64_t i = 0; i < group; ++i) {
      const float* src = t.query + ((t.first_token + qi) * t.num_heads + t.kv_head * group + i) * dim;
      float* row = q + (qi * group + i) * dim;
      for (int64_t d = 0; d < dim; d += W) Vec::store(row + d, Vec::mul(Vec::load(src + d), scale));
    }
  }
  for (int64_t i = 0; i < rows * dim; i += W) Vec::store(acc + i, Vec::zero());
  for (int64_t r = 0; r < rows; ++r) running_max[r] = -__builtin_inff(), running_sum[r] = 0.0f;

  const float* keys[kKeySpan];
  const float* values[kKeySpan];
  const int64_t num_keys = t.first_position + t.num_queries;
  for (int64_t span = 0; span < num_keys; span += kKeySpan) {
    const int64_t span_keys = num_keys - span < kKeySpan ? num_keys - span : kKeySpan;
    for (int64_t j = 0; j < span_keys; ++j) {
      const int64_t position = span + j;
      const int64_t slot = t.block_ids[position / t.block_size] * t.block_size + position % t.block_size;
      const int64_t offset = (slot * t.num_kv_heads + t.kv_head) * dim;
      keys[j] = t.key_cache + offset;
      values[j] = t.value_cache + offset;
    }
    const int64_t padded_keys = (span_keys + 3) / 4 * 4;  // extra keys repeat one; their scores are never read
    for (int64_t j = span_keys; j < padded_keys; ++j) keys[j] = keys[0];
    // Queries before the span see none of it.
    const int64_t first_query = span > t.first_position ? span - t.first_position : 0;
    int64_t r = first_query * group;
    for (; r + 3 <= rows; r += 3) score_rows<3>(q + r * dim, dim, keys, padded_keys, scores + r * kKeySpan);
    if (rows - r == 2) score_rows<2>(q + r * dim, dim, keys, padded_keys, scores + r * kKeySpan);
    if (rows - r == 1) score_rows<1>(q + r * dim, dim, keys, padded_keys, scores + r * kKeySpan);
    for (r = first_query * group; r < rows; ++r) {
      const int64_t position = t.first_position + r / group;
      const int64_t visible = position - span + 1 < span_keys ? position - span + 1 : span_keys;
      float* row_scores = scores + r * kKeySpan;
      softmax_update(row_scores, visible, running_max + r, running_sum + r, acc + r * dim, dim);
      accumulate_values(acc + r * dim, row_scores, values, visible, dim);
    }
  }
  for (int64_t qi = 0; qi < t.num_queries; ++qi) {
    for (int64_t i = 0; i < group; ++i) {
      const int64_t r = qi * group + i;
      const reg inv = Vec::set1(1.0f / running_sum[r]);
      float* dst = t.out + (t.first_token + qi) * t.num_heads * dim + (t.kv_head * group + i) * dim;
      for (int64_t d = 0; d < dim; d += W) Vec::store(dst + d, Vec::mul(Vec::load(acc + r * dim + d), inv));
    }
  }
}

static const KernelSet kKernels = {rms_norm_row, silu_and_mul_row, rotate_head, attend_tile};
