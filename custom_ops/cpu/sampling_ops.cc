// bs_sample_rows: each row's draw from softmax(logits / temperature), with min_p, top_k and top_p, as
// gpu_worker/token_draw.py draws it in Paddle ops (the reference). Paddle's CPU ops for that draw run on one
// thread: 12-36 ms for 64 rows of SmolLM2's 49152 logits at temperature 1 (the model's step is ~35 ms), and
// with top_p alone (a sort of every row) 210 ms (2-core EPYC). Here the masses are one vectorised pass of exp
// per row (KernelSet::draw_masses), the rows in parallel, and a truncated row sorts only its candidates
// (benchmarks/bench_sampling.py: 64 rows at temperature 1 ~1.4 ms, top_k 50 ~1.5 ms, top_p 0.9 ~14 ms).
#include <algorithm>
#include <cstdint>
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

// A thread's scratch for its rows.
struct Scratch {
  std::vector<float> masses, group_sums;
  std::vector<int32_t> candidates;
  explicit Scratch(int64_t width) : masses(width), group_sums(width / bs::kDrawGroup + 1) { candidates.reserve(width); }
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

// The candidates of a truncated draw, in s.candidates: the entries of mass >= t for the largest t of 2^-2,
// 2^-4, ... (relative to the largest entry's 1), then 0, whose entries hold the top_k, or without top_k more
// than top_p of the whole mass (by a hair: the walk's roundings). A group whose sum is under t holds none.
void gather_candidates(Scratch& s, int64_t width, double total, const DrawParams& p) {
  const int64_t num_groups = (width + bs::kDrawGroup - 1) / bs::kDrawGroup;
  for (float at_least = 0.25f;; at_least = at_least > bs::kMinDrawnMass ? at_least / 4.0f : 0.0f) {
    s.candidates.clear();
    double mass = 0.0;
    for (int64_t g = 0; g < num_groups; ++g) {
      if (s.group_sums[g] < at_least || s.group_sums[g] == 0.0f) continue;
      for (int64_t j = g * bs::kDrawGroup; j < width && j < (g + 1) * bs::kDrawGroup; ++j) {
        if (s.masses[j] > 0.0f && s.masses[j] >= at_least) {
          s.candidates.push_back(static_cast<int32_t>(j));
          mass += s.masses[j];
        }
      }
    }
    const bool enough = p.top_k > 0 ? static_cast<int64_t>(s.candidates.size()) >= p.top_k
                                    : mass > p.top_p * total * (1.0 + 1e-6);
    if (enough || at_least == 0.0f) return;
  }
}

// The draw among the top_k largest, cut to the smallest prefix holding top_p of their mass, walked from the
// largest down (ties by id), as the reference sorts; only the candidates are sorted.
int64_t draw_truncated(const float* x, Scratch& s, int64_t width, double total, const DrawParams& p) {
  gather_candidates(s, width, total, p);
  std::sort(s.candidates.begin(), s.candidates.end(),
            [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  const int64_t num_candidates =
      p.top_k > 0 ? std::min<int64_t>(p.top_k, static_cast<int64_t>(s.candidates.size())) : s.candidates.size();
  double kept_total = total;  // top_k: the probabilities are over the top_k alone
  if (p.top_k > 0) {
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
