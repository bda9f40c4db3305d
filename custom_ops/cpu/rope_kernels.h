// The rotary embedding of one head, into the query (fp32) or a KV cache, and the values written into a cache.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

// One value as the cache stores it: itself, or rounded to bf16 (nearest even; inputs are finite).
template <class Out>
static inline Out to_cache(float x);
template <>
inline float to_cache<float>(float x) {
  return x;
}
template <>
inline bf16 to_cache<bf16>(float x) {
  unsigned bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  return static_cast<bf16>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// Rotary embedding of one head into the query (fp32) or the cache (Out = float or bf16).
template <class Out>
static void rotate_head_to(const float* x, const float* cos, const float* sin, Out* out, int64_t head_dim) {
  const int64_t half = head_dim / 2, full = half - half % W;
  for (int64_t i = 0; i < full; i += W) {
    reg x1 = Vec::load(x + i), x2 = Vec::load(x + half + i), c = Vec::load(cos + i), s = Vec::load(sin + i);
    Vec::store(out + i, Vec::sub(Vec::mul(x1, c), Vec::mul(x2, s)));
    Vec::store(out + half + i, Vec::fmadd(x1, s, Vec::mul(x2, c)));
  }
  for (int64_t i = full; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    out[i] = to_cache<Out>(x1 * cos[i] - x2 * sin[i]);
    out[half + i] = to_cache<Out>(x2 * cos[i] + x1 * sin[i]);
  }
}

static void rotate_head(const float* x, const float* cos, const float* sin, float* out, int64_t head_dim) {
  rotate_head_to(x, cos, sin, out, head_dim);
}

static void rotate_head_bf16(const float* x, const float* cos, const float* sin, bf16* out, int64_t head_dim) {
  rotate_head_to(x, cos, sin, out, head_dim);
}

static void store_bf16(const float* x, bf16* out, int64_t width) {
  const int64_t full = width - width % W;
  for (int64_t i = 0; i < full; i += W) Vec::store(out + i, Vec::load(x + i));
  for (int64_t i = full; i < width; ++i) out[i] = to_cache<bf16>(x[i]);
}
