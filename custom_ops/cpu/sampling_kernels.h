// The sampling kernels over a row of logits: its argmax (greedy), and the masses of a draw from its softmax.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

// The largest of x[0..width), NaNs left out (-inf for a row of NaNs).
static float row_max(const float* x, int64_t width) {
  const int64_t full = width - width % W;
  reg maxes = Vec::set1(-__builtin_inff());
  for (int64_t i = 0; i < full; i += W) maxes = Vec::max(Vec::load(x + i), maxes);  // a NaN lane keeps `maxes`
  float best = Vec::reduce_max(maxes);
  for (int64_t i = full; i < width; ++i) best = x[i] > best ? x[i] : best;
  return best;
}

// The index of the largest of x[0..width): the first if tied; NaNs never win (an all-NaN row gives 0).
static int64_t argmax_row(const float* x, int64_t width) {
  const int64_t full = width - width % W;
  const float best = row_max(x, width);
  for (int64_t i = 0; i < full; i += W) {
    const int lane = Vec::first_equal(Vec::load(x + i), best);
    if (lane >= 0) return i + lane;
  }
  for (int64_t i = full; i < width; ++i) {
    if (x[i] == best) return i;
  }
  return 0;
}

// The masses of a row's draw (KernelSet::draw_masses), and the sums of each kDrawGroup of them.
static double draw_masses(const float* x, int64_t width, float temperature, float min_p, float* masses,
                          float* group_sums) {
  static_assert(kDrawGroup % W == 0, "a group is whole vectors");
  const int64_t full = width - width % kDrawGroup;
  const float shift = row_max(x, width) / temperature;  // = the largest x / temperature: division rounds monotonically
  const float at_least = min_p > kMinDrawnMass ? min_p : kMinDrawnMass;  // the largest entry's mass is 1
  const reg t = Vec::set1(temperature), s = Vec::set1(shift), floor = Vec::set1(at_least);
  double total = 0.0;
  int64_t g = 0;
  for (int64_t i = 0; i < full; i += kDrawGroup, ++g) {
    reg sum = Vec::zero();
    for (int64_t v = i; v < i + kDrawGroup; v += W) {
      const reg mass = Vec::keep_at_least(vexp(Vec::sub(Vec::div(Vec::load(x + v), t), s)), floor);
      Vec::store(masses + v, mass);
      sum = Vec::add(sum, mass);
    }
    group_sums[g] = Vec::reduce_add(sum);
    total += group_sums[g];
  }
  if (full < width) {
    float tail = 0.0f;
    for (int64_t i = full; i < width; ++i) {
      const float mass = sexp(x[i] / temperature - shift);
      masses[i] = mass >= at_least ? mass : 0.0f;
      tail += masses[i];
    }
    group_sums[g] = tail;
    total += tail;
  }
  return total;
}
