// bs_sample_rows: each row's draw from softmax(logits / temperature), with min_p, top_k and top_p, as
// worker/sample/paddle_draw.py draws it in Paddle ops (the reference). Paddle's CPU ops for that draw run on one
// thread: 37-41 ms for 64 rows of SmolLM2's 49152 logits at temperature 1 (the model's step is ~35 ms), and
// with top_p alone (a sort of every row) 215-270 ms (2-core EPYC Zen 5). Here the masses are one vectorised
// pass of exp per row (KernelSet::draw_masses), the rows in parallel, and a truncated row bins its masses and
// sorts only the bins its walks stop in (benchmarks/bench_sampling.py, 64 rows: temperature 1 ~1 ms, top_k 50
// ~2 ms, top_p 0.9 ~4 ms, top_p 0.9 at temperature 2.5 (flat rows) ~5 ms).
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

// Bins of the masses (0, 1] by the float's exponent and 6 leading mantissa bits: a bin holds masses within
// 1.6% of each other, and a higher bin only larger masses. A flat row (a high temperature) puts a few hundred
// of SmolLM2's 49152 entries in a bin near its middle, a model's usual row a handful.
constexpr int kBinShift = 17;
constexpr int kTopBin = 0x3F800000 >> kBinShift;  // 1.0f's, the largest mass's
constexpr int kBins = kTopBin + 1;  // bin 0 (masses under 2^-126, never candidates): an entry that is none
inline int bin_of(float mass) {
  uint32_t bits;
  std::memcpy(&bits, &mass, sizeof bits);
  return static_cast<int>(bits >> kBinShift);
}
inline float bin_floor(int bin) {  // the smallest mass of a bin
  const uint32_t bits = static_cast<uint32_t>(bin) << kBinShift;
  float mass;
  std::memcpy(&mass, &bits, sizeof mass);
  return mass;
}

// One bin of a truncated row's candidates: `first` candidates are in higher bins. Its entries are gathered
// into `order` at [begin, end) (all bins' at once where they are few) and sorted (by logit, largest first,
// ties by id) only once a walk has to look inside it; a cut keeps `count` of them.
struct Segment {
  int bin;
  int64_t first, count;
  double mass;
  int64_t begin = 0, end = 0;
  bool gathered = false, sorted = false;
};

// Up to this many candidates in the bins a row needs are gathered in one pass over its groups (a model's
// usual row: a few dozen); more (a flat row) are gathered bin by bin, only those a walk stops in.
constexpr int64_t kGatherAllAtMost = 256;

// A thread's scratch for its rows, kept from call to call (a fresh one per call cost page faults: its masses
// alone are 192 KiB for SmolLM2's vocabulary).
struct Scratch {
  std::vector<float> masses, group_sums;
  std::vector<uint16_t> bins;  // each entry's bin (0: no candidate) in the groups binned
  std::vector<int32_t> binned_groups;  // the groups that hold a candidate, in id order
  std::vector<int64_t> bin_counts = std::vector<int64_t>(kBins), cursor = std::vector<int64_t>(kBins);
  std::vector<double> bin_masses = std::vector<double>(kBins);
  std::vector<int32_t> order;  // the gathered bins' entries
  std::vector<Segment> segments;

  static Scratch& of_thread(int64_t width) {
    thread_local Scratch scratch;
    if (static_cast<int64_t>(scratch.masses.size()) < width) {
      scratch.masses.resize(width);
      scratch.bins.resize(width);
      scratch.group_sums.resize(width / bs::kDrawGroup + 1);
      scratch.order.resize(width);
      scratch.binned_groups.resize(width / bs::kDrawGroup + 1);
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

// A truncated row's candidates: the entries of mass >= at_least, in the groups whose sum reaches it.
struct Candidates {
  const float* x;
  int64_t width, num_groups;
  float at_least;

  int64_t num_binned = 0;  // groups in s.binned_groups
  int64_t gathered = 0;    // entries in s.order

  // f(j) for each entry j of the binned groups whose sum reaches `floor` (the others hold no entry that does).
  template <class F>
  void each_entry_from(const Scratch& s, float floor, F f) const {
    for (int64_t i = 0; i < num_binned; ++i) {
      const int64_t g = s.binned_groups[i];
      if (s.group_sums[g] < floor) continue;
      const int64_t end = std::min(width, (g + 1) * bs::kDrawGroup);
      for (int64_t j = g * bs::kDrawGroup; j < end; ++j) f(j);
    }
  }

  // Each candidate's bin, and each bin's count and mass.
  void bin(Scratch& s) {
    const int lowest = bin_of(at_least);
    std::fill(s.bin_counts.begin() + lowest, s.bin_counts.end(), 0);
    std::fill(s.bin_masses.begin() + lowest, s.bin_masses.end(), 0.0);
    int64_t* counts = s.bin_counts.data();
    double* sums = s.bin_masses.data();
    num_binned = 0;
    for (int64_t g = 0; g < num_groups; ++g) {
      if (!(s.group_sums[g] > 0.0f && s.group_sums[g] >= at_least)) continue;  // no candidate in the group
      s.binned_groups[num_binned++] = static_cast<int32_t>(g);
      const int64_t end = std::min(width, (g + 1) * bs::kDrawGroup);
      for (int64_t j = g * bs::kDrawGroup; j < end; ++j) {
        const float m = s.masses[j];
        const int b = m >= at_least ? bin_of(m) : 0;
        s.bins[j] = static_cast<uint16_t>(b);
        if (b != 0) ++counts[b], sums[b] += m;
      }
    }
  }

  // Every segment's entries gathered into `order`, in the segments' order (s.segments: every bin from kTopBin
  // down to `lowest` that has candidates, `first` of each set).
  void gather_all(Scratch& s, int lowest) {
    for (Segment& segment : s.segments) {
      s.cursor[segment.bin] = segment.begin = segment.first;
      segment.end = segment.first + segment.count;
      segment.gathered = true;
    }
    each_entry_from(s, bin_floor(lowest), [&s, lowest](int64_t j) {
      const int b = s.bins[j];
      if (b >= lowest) s.order[s.cursor[b]++] = static_cast<int32_t>(j);
    });
    gathered = s.segments.empty() ? 0 : s.segments.back().end;
  }

  // The segment's entries gathered into `order` (after those gathered before) unless they are, and sorted.
  void gather(Scratch& s, Segment& segment) {
    if (segment.sorted) return;
    if (!segment.gathered) {
      const uint16_t bin = static_cast<uint16_t>(segment.bin);
      segment.begin = gathered;
      each_entry_from(s, bin_floor(segment.bin), [&s, bin, this](int64_t j) {
        if (s.bins[j] == bin) s.order[gathered++] = static_cast<int32_t>(j);
      });
      segment.end = gathered;
      segment.gathered = true;
    }
    const float* logits = x;
    std::sort(s.order.begin() + segment.begin, s.order.begin() + segment.end,
              [logits](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    segment.sorted = true;
  }
};

// The draw among the top_k largest, cut to the smallest prefix holding top_p of their mass, walked from the
// largest down (ties by id), as the reference sorts. The entries are binned by mass: the walks skip whole bins
// by their sums and gather and sort only the bins they stop in (the top_k's last, the top_p's, the draw's).
int64_t draw_truncated(const float* x, Scratch& s, int64_t width, double total, const DrawParams& p) {
  const int64_t num_groups = (width + bs::kDrawGroup - 1) / bs::kDrawGroup;
  // The candidates: first only the entries of mass >= 2^-8 (a model's distribution has few; the groups whose sum
  // is under it are skipped whole), all of them where those do not hold the top_k (or top_p of the mass). A flat
  // row without top_k (over a quarter of its groups reach 2^-8) is binned whole at once: binning its entries of
  // mass >= 2^-8 would cost about as much, and rarely hold its top_p (they usually hold a top_k).
  constexpr float kFirstAtLeast = 1.0f / 256.0f;
  int64_t heavy_groups = 0;
  if (p.top_k == 0) {
    for (int64_t g = 0; g < num_groups; ++g) heavy_groups += s.group_sums[g] >= kFirstAtLeast;
  }
  Candidates candidates{x, width, num_groups, heavy_groups * 4 > num_groups ? bs::kMinDrawnMass : kFirstAtLeast};
  int lowest = kTopBin;  // the lowest bin needed
  for (;; candidates.at_least = bs::kMinDrawnMass) {  // draw_masses' masses are 0 or at least kMinDrawnMass
    candidates.bin(s);
    // From the highest bin down: to the one that completes the top_k, or (without top_k) the one where top_p
    // of the whole mass is reached, and one more (a rounding of the walk may keep one more entry).
    int64_t count = 0;
    double mass = 0.0;
    bool reached = false, enough = false;
    for (int b = kTopBin; b >= bin_of(candidates.at_least); --b) {
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
    if (enough || candidates.at_least == bs::kMinDrawnMass) break;
  }
  s.segments.clear();
  int64_t first = 0;
  for (int b = kTopBin; b >= lowest; --b) {
    if (s.bin_counts[b] == 0) continue;
    Segment segment;
    segment.bin = b, segment.first = first, segment.count = s.bin_counts[b], segment.mass = s.bin_masses[b];
    s.segments.push_back(segment);
    first += s.bin_counts[b];
  }
  if (first <= kGatherAllAtMost) candidates.gather_all(s, lowest);
  // A gathered segment cut to its first `keep` entries (their mass summed).
  auto cut_to = [&s](Segment& segment, int64_t keep) {
    segment.end = segment.begin + keep;
    segment.count = keep;
    segment.mass = 0.0;
    for (int64_t e = segment.begin; e < segment.end; ++e) segment.mass += s.masses[s.order[e]];
  };
  // top_k: the entries after the k-th go (the segment holding the k-th gathered and cut); the probabilities are
  // over the top_k alone.
  double kept_total = total;
  if (p.top_k > 0) {
    for (size_t i = 0; i < s.segments.size(); ++i) {
      Segment& segment = s.segments[i];
      if (segment.first + segment.count > p.top_k) {
        candidates.gather(s, segment);
        cut_to(segment, p.top_k - segment.first);
        s.segments.resize(i + 1);
      }
    }
    kept_total = 0.0;
    for (const Segment& segment : s.segments) kept_total += segment.mass;
  }
  // top_p: an entry stays while the mass before it is under top_p (the largest always stays); whole segments
  // whose mass ends under it stay, the one where it is reached is gathered and cut.
  const double cut = p.top_p * kept_total;
  double before = 0.0;
  for (size_t i = 0; i < s.segments.size(); ++i) {
    Segment& segment = s.segments[i];
    if (before + segment.mass < cut) {
      before += segment.mass;
      continue;
    }
    candidates.gather(s, segment);
    int64_t end = segment.begin;
    double kept = 0.0;
    for (; end < segment.end && (before + kept < cut || (i == 0 && end == segment.begin)); ++end) kept += s.masses[s.order[end]];
    cut_to(segment, end - segment.begin);
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
    candidates.gather(s, segment);
    for (int64_t e = segment.begin; e < segment.end; ++e) {
      cumulative += s.masses[s.order[e]];
      if (cumulative > target) return s.order[e];
    }
    for (size_t back = i + 1; back-- > 0;) {  // a rounding fell short: the last kept entry (of a gathered segment)
      if (s.segments[back].sorted && s.segments[back].end > s.segments[back].begin) return s.order[s.segments[back].end - 1];
    }
    break;
  }
  return -1;
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
