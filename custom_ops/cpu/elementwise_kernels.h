// The row-wise elementwise kernels: residual add + RMSNorm, and SiLU-and-multiply of a fused gate|up row.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

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
  for (int64_t i = 0; i < full; i += W) {
    Vec::store(out + i, silu_times(Vec::load(gate_up + i), Vec::load(gate_up + width + i)));
  }
  for (int64_t i = full; i < width; ++i) {
    const float gate = gate_up[i];
    out[i] = gate / (1.0f + sexp(-gate)) * gate_up[width + i];
  }
}
