// Vector exp and SiLU over `Vec` (simd_avx2.h or simd_avx512.h, with `reg` and `W`): included inside a
// `#pragma GCC target` region after it, by kernel_impl.h and by the bf16 GEMM (whose fused SiLU-and-multiply
// must compute what silu_and_mul_row does, to the bit); no include guard, only builtins.

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

// silu(gate) * up = gate / (1 + e^-gate) * up.
static inline reg silu_times(reg gate, reg up) {
  return Vec::mul(Vec::div(gate, Vec::add(Vec::set1(1.0f), vexp(Vec::sub(Vec::zero(), gate)))), up);
}
