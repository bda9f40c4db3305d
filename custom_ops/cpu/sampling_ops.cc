// bs_sample_rows: each row's draw from softmax(logits / temperature), with min_p, top_k and top_p, as
// gpu_worker/token_draw.py draws it in Paddle ops (the reference). Paddle's CPU ops for that draw run on one
// thread: 12-36 ms for 64 rows of SmolLM2's 49152 logits at temperature 1 (the model's step is ~35 ms), and
// with top_p alone (a sort of every row) 210 ms (2-core EPYC). Here the masses are one vectorised pass of exp
// per row (KernelSet::draw_masses), the rows in parallel, and a truncated row sorts only its candidates.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "kernel_set.h"
#include "paddle/extension.h"

namespace {

// One row's parameters, as the params tensor holds them (float64 [rows, 5]).
struct DrawParams {
  float temperature;  // > 0
  float min_p;        // in [0, 1]
  double uniform;     // in [0, 1)
  int64_t top_k;      // 0: none
  double top_p;       // >= 1: none (0: the largest alone)
  bool truncated() const { return top_k > 0 || top_p < 1.0; }
};

// Bins of the masses (0, 1] by the float's exponent and 3 leading mantissa bits (bits >> 20): a bin holds
// masses within 12.5% of each other, and a higher bin only larger masses.
constexpr int kBins = 1024;
inline int bin_of(float mass) {
  uint32_t bits;
  std::memcpy(&bits, &mass, sizeof bits);
  return static_cast<int>(bits >> 20);  // < kBins for 0 < mass <= 1 (1.0f: 1016)
}

// A thread's scratch for its rows.
struct Scratch {
  std::vector<float> masses, group_sums;
  std::vector<int32_t> candidates;
  std::vector<int64_t> bin_counts;
  std::vector<double> bin_masses;
  explicit Scratch(int64_t width)
      : masses(width), group_sums(width / bs::kDrawGroup + 1), bin_counts(kBins), bin_masses(kBins) {
    candidates.reserve(width);
  }
};

// The draw in id order (no top_k/top_p): the first entry whose cumulative mass exceeds uniform * total, the
// groups' fp32 sums skipped over in fp64, then the entries of the crossing group one by one.
int64_t draw_in_id_order(const Scratch& s, int64_t width, double total, double uniform) {
  const double target = uniform * total;
  const int64_t num_groups = (width + bs::kDrawGroup - 1) / bs::kDrawGroup;
  double cumulative = 0.0;
  int64_t g = 0;
  for (; g + 1 < num_groups && cumulative + s.group_sums[g] <= target; ++g) cumulative += s.group_sums[g];
  int64_t chosen = -1;
  for (int64_t j = g * bs::kDrawGroup; j < width && j < (g + 1) * bs::kDrawGroup; ++j) {
    if (s.masses[j] > 0.0f) {
      chosen = j;
      cumulative += s.masses[j];
      if (cumulative > target) return j;
    }
  }
  if (chosen >= 0) return chosen;  // the group's fp32 sum crossed the target, its fp64 walk fell short by a rounding
  for (int64_t j = width - 1; j >= 0; --j) {  // the last group has no mass: the last entry that has
    if (s.masses[j] > 0.0f) return j;
  }
  return -1;
}

// The draw among the top_k largest, cut to the smallest prefix holding top_p of their mass, walked from the
// largest down (ties by id), as the reference sorts. Only the candidates are sorted: the entries of the bins
// from the largest down to the one where the top_k, or top_p of the whole mass (and one bin more: a rounding
// may keep one entry more), are reached.
int64_t draw_truncated(const float* x, Scratch& s, int64_t width, double total, const DrawParams& p) {
  std::fill(s.bin_counts.begin(), s.bin_counts.end(), 0);
  std::fill(s.bin_masses.begin(), s.bin_masses.end(), 0.0);
  int64_t positive = 0;
  for (int64_t j = 0; j < width; ++j) {
    if (s.masses[j] > 0.0f) {
      const int b = bin_of(s.masses[j]);
      ++s.bin_counts[b];
      s.bin_masses[b] += s.masses[j];
      ++positive;
    }
  }
  const bool by_count = p.top_k > 0 && p.top_k < positive;
  const int64_t keep = by_count ? p.top_k : positive;
  int lowest = 0;  // the lowest bin of the candidates
  int64_t count = 0;
  double mass = 0.0;
  bool reached = false;
  for (int b = kBins - 1; b >= 0; --b) {
    if (s.bin_counts[b] == 0) continue;
    if (reached) {  // one bin past the top_p's
      lowest = b;
      break;
    }
    count += s.bin_counts[b];
    mass += s.bin_masses[b];
    lowest = b;
    if (by_count ? count >= keep : mass >= p.top_p * total) {
      if (by_count) break;
      reached = true;
    }
  }
  s.candidates.clear();
  for (int64_t j = 0; j < width; ++j) {
    if (s.masses[j] > 0.0f && bin_of(s.masses[j]) >= lowest) s.candidates.push_back(static_cast<int32_t>(j));
  }
  std::sort(s.candidates.begin(), s.candidates.end(), [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  const int64_t num_candidates = std::min<int64_t>(keep, static_cast<int64_t>(s.candidates.size()));
  double kept_total = total;  // top_k: the probabilities are over the top_k alone
  if (by_count) {
    kept_total = 0.0;
    for (int64_t i = 0; i < num_candidates; ++i) kept_total += s.masses[s.candidates[i]];
  }
  int64_t num_kept = 1;  // the largest always stays
  double before = s.masses[s.candidates[0]];
  for (; num_kept < num_candidates && before < p.top_p * kept_total; ++num_kept) before += s.masses[s.candidates[num_kept]];
  double kept_mass = 0.0;
  for (int64_t i = 0; i < num_kept; ++i) kept_mass += s.masses[s.candidates[i]];
  const double target = p.uniform * kept_mass;
  double cumulative = 0.0;
  for (int64_t i = 0; i < num_kept; ++i) {
    cumulative += s.masses[s.candidates[i]];
    if (cumulative > target) return s.candidates[i];
  }
  return s.candidates[num_kept - 1];
}

std::vector<paddle::Tensor> SampleRows(const paddle::Tensor& logits, const paddle::Tensor& params, int isa) {
  PD_CHECK(logits.is_cpu() && logits.dtype() == paddle::DataType::FLOAT32 && logits.shape().size() == 2,
           "logits must be a 2-d float32 CPU tensor");
  const int64_t rows = logits.shape()[0], width = logits.shape()[1];
  PD_CHECK(width > 0 && width < (int64_t{1} << 31), "logits must have columns (fewer than 2^31)");
  PD_CHECK(params.is_cpu() && params.dtype() == paddle::DataType::FLOAT64 && params.shape().size() == 2 &&
               params.shape()[0] == rows && params.shape()[1] == 5,
           "params must be float64 [rows, 5]: temperature, min_p, uniform, top_k, top_p");
  const double* table = params.data<double>();
  std::vector<DrawParams> draws(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = table + 5 * r;
    PD_CHECK(row[0] > 0.0 && row[1] >= 0.0 && row[1] <= 1.0 && row[2] >= 0.0 && row[2] < 1.0 && row[3] >= 0.0 &&
                 row[3] == static_cast<double>(static_cast<int64_t>(row[3])) && row[4] >= 0.0,
             "row ", r, ": a draw needs temperature > 0, min_p in [0, 1], uniform in [0, 1), a whole top_k >= 0 ",
             "and top_p >= 0");
    draws[r] = {static_cast<float>(row[0]), static_cast<float>(row[1]), row[2], static_cast<int64_t>(row[3]), row[4]};
  }
  const auto& kernels = bs::kernels_for(bs::resolve_isa(isa));
  auto out = paddle::empty({rows}, paddle::DataType::INT64, logits.place());
  const float* values = logits.data<float>();
  int64_t* index = out.data<int64_t>();
#pragma omp parallel if (rows > 1 && rows * width >= bs::kParallelFloats)
  {
    Scratch scratch(width);
#pragma omp for schedule(dynamic)
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = values + r * width;
      const DrawParams& p = draws[r];
      const double total =
          kernels.draw_masses(x, width, p.temperature, p.min_p, scratch.masses.data(), scratch.group_sums.data());
      int64_t chosen = -1;
      if (total > 0.0 && total < __builtin_inf()) {  // else no mass (all NaN, or a +inf): argmax's entry
        chosen = p.truncated() ? draw_truncated(x, scratch, width, total, p)
                               : draw_in_id_order(scratch, width, total, p.uniform);
      }
      index[r] = chosen >= 0 ? chosen : kernels.argmax_row(x, width);
    }
  }
  return {out};
}

}  // namespace

PD_BUILD_OP(bs_sample_rows)
    .Inputs({"Logits", "Params"})
    .Outputs({"Out"})
    .Attrs({"isa: int"})
    .SetKernelFn(PD_KERNEL(SampleRows));
