// bs_sample_rows: each row's draw from softmax(logits / temperature), with min_p, top_k and top_p, as
// gpu_worker/token_draw.py draws it in Paddle ops (the reference). Paddle's CPU ops for that draw run on one
// thread: 12-36 ms for 64 rows of SmolLM2's 49152 logits at temperature 1 (the model's step is ~35 ms), and
// with top_p alone (a sort of every row) 210 ms (2-core EPYC). Here the masses are one vectorised pass of exp
// per row (KernelSet::draw_masses), the rows in parallel, and a truncated row bins its masses and sorts only
// the bins its walks stop in (benchmarks/bench_sampling.py, 64 rows: temperature 1 ~1.5 ms, top_k 50 ~3 ms,
// top_p 0.9 ~7 ms).
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

// Bins of the masses (0, 1] by the float's exponent and 3 leading mantissa bits: a bin holds masses within
// 12.5% of each other, and a higher bin only larger masses.
constexpr int kBins = 1024;
inline int bin_of(float mass) {
  uint32_t bits;
  std::memcpy(&bits, &mass, sizeof bits);
  return static_cast<int>(bits >> 20);  // < kBins for 0 < mass <= 1 (1.0f: 1016)
}
inline float bin_floor(int bin) {  // the smallest mass of a bin
  const uint32_t bits = static_cast<uint32_t>(bin) << 20;
  float mass;
  std::memcpy(&mass, &bits, sizeof mass);
  return mass;
}

// A run of a truncated row's candidates: one bin's entries, in `order` at [begin, end), sorted (by logit,
// largest first, ties by id) only once a walk has to look inside it.
struct Segment {
  int64_t begin, end;
  double mass;
  bool sorted;
};

// A thread's scratch for its rows, kept from call to call (a fresh one per call cost page faults: its masses
// alone are 192 KiB for SmolLM2's vocabulary).
struct Scratch {
  std::vector<float> masses, group_sums;
  std::vector<int64_t> bin_counts = std::vector<int64_t>(kBins), cursor = std::vector<int64_t>(kBins);
  std::vector<double> bin_masses = std::vector<double>(kBins);
  std::vector<int32_t> order;  // the candidates by bin, the highest bin first
  std::vector<Segment> segments;

  static Scratch& of_thread(int64_t width) {
    thread_local Scratch scratch;
    if (static_cast<int64_t>(scratch.masses.size()) < width) {
      scratch.masses.resize(width);
      scratch.group_sums.resize(width / bs::kDrawGroup + 1);
      scratch.order.reserve(width);
    }
    return scratch;
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

void sort_segment(const float* x, std::vector<int32_t>& order, Segment& segment) {
  if (segment.sorted) return;
  std::sort(order.begin() + segment.begin, order.begin() + segment.end,
            [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  segment.sorted = true;
}

// The draw among the top_k largest, cut to the smallest prefix holding top_p of their mass, walked from the
// largest down (ties by id), as the reference sorts. The entries are binned by mass: the walks skip whole bins
// by their sums and sort only the bins they stop in (the top_k's last, the top_p's, the draw's).
int64_t draw_truncated(const float* x, Scratch& s, int64_t width, double total, const DrawParams& p) {
  const int64_t num_groups = (width + bs::kDrawGroup - 1) / bs::kDrawGroup;
  // The entries binned: first only those of mass >= 2^-8 (a model's distribution has few; the groups whose sum
  // is under it are skipped whole), all of them where those do not hold the top_k (or top_p of the mass).
  int lowest = kBins - 1;  // the lowest bin needed
  float at_least = 1.0f / 256.0f;
  for (;; at_least = 0.0f) {
    std::fill(s.bin_counts.begin(), s.bin_counts.end(), 0);
    std::fill(s.bin_masses.begin(), s.bin_masses.end(), 0.0);
    for (int64_t g = 0; g < num_groups; ++g) {
      if (s.group_sums[g] == 0.0f || s.group_sums[g] < at_least) continue;
      for (int64_t j = g * bs::kDrawGroup; j < width && j < (g + 1) * bs::kDrawGroup; ++j) {
        if (s.masses[j] > 0.0f && s.masses[j] >= at_least) {
          const int b = bin_of(s.masses[j]);
          ++s.bin_counts[b];
          s.bin_masses[b] += s.masses[j];
        }
      }
    }
    // From the highest bin down: to the one that completes the top_k, or (without top_k) the one where top_p
    // of the whole mass is reached, and one more (a rounding of the walk may keep one more entry).
    int64_t count = 0;
    double mass = 0.0;
    bool reached = false, enough = false;
    for (int b = kBins - 1; b >= 0; --b) {
      if (s.bin_counts[b] == 0) continue;
      lowest = b;
      if (reached) break;
      count += s.bin_counts[b];
      mass += s.bin_masses[b];
      if (p.top_k > 0 ? count >= p.top_k : mass >= p.top_p * total) {
        enough = p.top_k > 0 || mass > p.top_p * total * (1.0 + 1e-6);
        if (p.top_k > 0) break;
        reached = true;
      }
    }
    if (enough || at_least == 0.0f) break;
  }
  s.segments.clear();
  int64_t position = 0;
  for (int b = kBins - 1; b >= lowest; --b) {
    if (s.bin_counts[b] == 0) continue;
    s.cursor[b] = position;
    s.segments.push_back({position, position + s.bin_counts[b], s.bin_masses[b], false});
    position += s.bin_counts[b];
  }
  s.order.resize(position);
  const float floor = std::max(bin_floor(lowest), at_least);  // the entries binned above: the same
  for (int64_t g = 0; g < num_groups; ++g) {
    if (s.group_sums[g] < floor) continue;  // no entry of the group reaches it
    for (int64_t j = g * bs::kDrawGroup; j < width && j < (g + 1) * bs::kDrawGroup; ++j) {
      const float m = s.masses[j];
      if (m > 0.0f && m >= at_least && bin_of(m) >= lowest) s.order[s.cursor[bin_of(m)]++] = static_cast<int32_t>(j);
    }
  }
  // top_k: the entries after the k-th go (the segment holding the k-th sorted and cut); the probabilities are
  // over the top_k alone.
  double kept_total = total;
  if (p.top_k > 0) {
    for (size_t i = 0; i < s.segments.size(); ++i) {
      Segment& segment = s.segments[i];
      if (segment.end > p.top_k) {
        sort_segment(x, s.order, segment);
        segment.end = p.top_k;
        segment.mass = 0.0;
        for (int64_t e = segment.begin; e < segment.end; ++e) segment.mass += s.masses[s.order[e]];
        s.segments.resize(i + 1);
      }
    }
    kept_total = 0.0;
    for (const Segment& segment : s.segments) kept_total += segment.mass;
  }
  // top_p: an entry stays while the mass before it is under top_p (the largest always stays); whole segments
  // whose mass ends under it stay, the one where it is reached is sorted and cut.
  const double cut = p.top_p * kept_total;
  double before = 0.0;
  for (size_t i = 0; i < s.segments.size(); ++i) {
    Segment& segment = s.segments[i];
    if (before + segment.mass < cut) {
      before += segment.mass;
      continue;
    }
    sort_segment(x, s.order, segment);
    int64_t end = segment.begin;
    double kept = 0.0;
    for (; end < segment.end && (before + kept < cut || (i == 0 && end == segment.begin)); ++end) kept += s.masses[s.order[end]];
    segment.end = end;
    segment.mass = kept;
    s.segments.resize(i + 1);
    break;
  }
  // The draw: the first kept entry whose cumulative mass exceeds uniform * the kept mass.
  double kept_mass = 0.0;
  for (const Segment& segment : s.segments) kept_mass += segment.mass;
  const double target = p.uniform * kept_mass;
  double cumulative = 0.0;
  for (size_t i = 0; i < s.segments.size(); ++i) {
    Segment& segment = s.segments[i];
    if (cumulative + segment.mass <= target && i + 1 < s.segments.size()) {
      cumulative += segment.mass;
      continue;
    }
    sort_segment(x, s.order, segment);
    for (int64_t e = segment.begin; e < segment.end; ++e) {
      cumulative += s.masses[s.order[e]];
      if (cumulative > target) return s.order[e];
    }
    for (size_t back = i + 1; back-- > 0;) {  // a rounding fell short: the last kept entry
      if (s.segments[back].end > s.segments[back].begin) return s.order[s.segments[back].end - 1];
    }
  }
  return s.order.empty() ? -1 : s.order[0];
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
    Scratch& scratch = Scratch::of_thread(width);
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
