// The rotary embedding of one head, into the query (fp32) or a KV cache, and a token's values written into a cache.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

// Rotary embedding of one head into the query (T = float) or a cache (its element type T; a scaled type's row is
// rotated whole, then written with its scale).
template <class T>
static void rotate_head_to(const float* x, const float* cos, const float* sin, T* out, int64_t head_dim) {
  if constexpr (KvElement<T>::kScaled) {
    float rotated[kMaxScaledHeadDim];
    rotate_head_to<float>(x, cos, sin, rotated, head_dim);
    KvElement<T>::store_scaled_row(rotated, out, head_dim);
  } else {
    const int64_t half = head_dim / 2, full = half - half % W;
    for (int64_t i = 0; i < full; i += W) {
      reg x1 = Vec::load(x + i), x2 = Vec::load(x + half + i), c = Vec::load(cos + i), s = Vec::load(sin + i);
      KvElement<T>::store(out + i, Vec::sub(Vec::mul(x1, c), Vec::mul(x2, s)));
      KvElement<T>::store(out + half + i, Vec::fmadd(x1, s, Vec::mul(x2, c)));
    }
    for (int64_t i = full; i < half; ++i) {
      const float x1 = x[i], x2 = x[half + i];
      out[i] = KvElement<T>::from_float(x1 * cos[i] - x2 * sin[i]);
      out[half + i] = KvElement<T>::from_float(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

// A token's values x [num_rows, head_dim] into its cache slot, as T: one row each (kv_row_elements apart).
template <class T>
static void store_row(const float* x, T* out, int64_t head_dim, int64_t num_rows) {
  if constexpr (KvElement<T>::kScaled) {
    for (int64_t r = 0; r < num_rows; ++r) {
      KvElement<T>::store_scaled_row(x + r * head_dim, out + r * kv_row_elements<T>(head_dim), head_dim);
    }
  } else {
    const int64_t width = head_dim * num_rows, full = width - width % W;
    for (int64_t i = 0; i < full; i += W) KvElement<T>::store(out + i, Vec::load(x + i));
    for (int64_t i = full; i < width; ++i) out[i] = KvElement<T>::from_float(x[i]);
  }
}
