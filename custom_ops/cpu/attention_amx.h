// A prefill span of a bf16 cache on AMX-BF16 (BS_AMX_ATTENTION, kernels_amx.cc): the scores (QKᵀ) and the values
// (PV) of a one-head tile of several queries by tdpbf16ps, in place of score_span_in_lanes and
// accumulate_values_dot. Elsewhere nothing: attention_tile.h calls it only under BS_AMX_ATTENTION.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace, after
// attention_bf16_dot.h and attention_span.h; no include guard, only builtins and own code (see kernel_impl.h).
//
// tdpbf16ps has vdpbf16ps's semantics (bf16 pairs in, fp32 sums) and sums in its own order: the same precision,
// a different rounding. Both products are C[rows][16 columns] += A[rows][16 words] . B[16 words][16 columns]:
// - scores: A = 16 query words of up to 16 rows (as to_bf16_pairs left them, dim / 2 words a row), B = 16 words
//   of 16 keys from the span's keys in lanes (keys_in_lanes: [dim / 2][kKeySpan] words, already B's layout),
//   C = those rows' scores of those keys, stored straight into the rows of `scores`;
// - values: A = the rows' probabilities as bf16 pairs of consecutive keys (16 pairs: 32 keys), B = 16 such pairs
//   of keys' values for 16 dims (values_in_pairs), C = the rows' accumulators, loaded and stored back. Two keys'
//   values are interleaved as accumulate_values_dot interleaves them (vpunpck{l,h}wd per 32 dims), so the
//   accumulators keep its permuted order and store_unpermuted reads them as before.
// Tile registers: tmm0..3 the sums of (upper | lower 16 rows) x (column block 0 | 1), tmm(2 * half + block);
// tmm4, tmm5 the upper and lower rows' A; tmm6, tmm7 the B of column blocks 0 and 1 (linear_amx_bf16.h's plan).

#ifdef BS_AMX_ATTENTION
#include "amx_tiles.h"

constexpr int kAmxAttentionRows = 2 * kTileRegisterRows;  // rows per pass: an upper and a lower A tile

// The tile shapes of a pass over `upper` + `lower` rows (both products have the same): loaded only when they
// change. Each thread loads its own (the configuration is per thread); release() before the tile leaves.
struct AttentionTiles {
  int upper = -1, lower = -1;

  inline void shape(int new_upper, int new_lower) {
    if (new_upper == upper && new_lower == lower) return;
    upper = new_upper, lower = new_lower;
    load_row_block_tiles(upper, lower, 2, 64, kTileRegisterRows);
  }

  inline void release() {
    if (upper >= 0) release_tiles();
    upper = lower = -1;
  }
};

// scores[r * kKeySpan + j] = the scores of the pass's rows (words: its first row's bf16 words, row_words a row)
// for keys [0, lane_keys) in lanes (kt; a multiple of 16), 32 keys at a time. ahead() is called about as often
// as score_span_in_lanes calls it for as many rows and keys (once per 3 rows and 4 keys).
template <class Ahead>
static inline void scores_on_tiles(const uint32_t* words, int64_t row_words, int upper, int lower, const uint32_t* kt,
                                   int64_t lane_keys, float* scores, Ahead& ahead) {
  const int64_t query_stride = row_words * 4;
  constexpr int64_t kLaneStride = kKeySpan * 4, kScoreStride = kKeySpan * 4;
  const uint32_t* lower_words = words + kTileRegisterRows * row_words;
  float* lower_scores = scores + kTileRegisterRows * kKeySpan;
  const int row_groups = (upper + lower + 2) / 3;
  for (int64_t j = 0; j < lane_keys; j += 32) {
    const bool two = j + 32 <= lane_keys;  // else one block of 16 keys
    for (int i = 0; i < row_groups * (two ? 8 : 4); ++i) ahead();
    BS_TILE_ZERO(0);
    if (two) BS_TILE_ZERO(1);
    if (lower > 0) {
      BS_TILE_ZERO(2);
      if (two) BS_TILE_ZERO(3);
    }
    for (int64_t w = 0; w < row_words; w += 16) {
      BS_TILE_LOAD(6, kt + w * kKeySpan + j, kLaneStride);
      if (two) BS_TILE_LOAD(7, kt + w * kKeySpan + j + 16, kLaneStride);
      BS_TILE_LOAD(4, words + w, query_stride);
      BS_TILE_DPBF16PS(0, 4, 6);
      if (two) BS_TILE_DPBF16PS(1, 4, 7);
      if (lower > 0) {
        BS_TILE_LOAD(5, lower_words + w, query_stride);
        BS_TILE_DPBF16PS(2, 5, 6);
        if (two) BS_TILE_DPBF16PS(3, 5, 7);
      }
    }
    BS_TILE_STORE(0, scores + j, kScoreStride);
    if (two) BS_TILE_STORE(1, scores + j + 16, kScoreStride);
    if (lower > 0) {
      BS_TILE_STORE(2, lower_scores + j, kScoreStride);
      if (two) BS_TILE_STORE(3, lower_scores + j + 16, kScoreStride);
    }
  }
}

// vt[p * dim + d + c] for the span's key pairs p (keys 2p, 2p + 1) up to num_keys rounded up to 32, and each 32 dims d:
// words c < 16 the pairs (value of key 2p, of key 2p + 1) of dims d + 8L + i (c = 4L + i), words c >= 16 those of
// dims d + 8L + 4 + i (c = 16 + 4L + i): accumulate_values_dot's interleave. Keys past num_keys are zeros (their
// probabilities are 0, and 0 times a leftover NaN would not be).
static inline void values_in_pairs(const Bf16* const* values, int64_t num_keys, int64_t dim, uint32_t* vt) {
  const int64_t pair_keys = (num_keys + 31) / 32 * 32;
  for (int64_t p = 0; p < pair_keys / 2; ++p) {
    const Bf16* first = 2 * p < num_keys ? values[2 * p] : nullptr;
    const Bf16* second = 2 * p + 1 < num_keys ? values[2 * p + 1] : nullptr;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i x = first != nullptr ? _mm512_loadu_si512(first + d) : _mm512_setzero_si512();
      const __m512i y = second != nullptr ? _mm512_loadu_si512(second + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(vt + p * dim + d, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(vt + p * dim + d + 16, _mm512_unpackhi_epi16(x, y));
    }
  }
}

// acc[r * dim + ...] += the pass's rows' probabilities (pairs: [kAmxAttentionRows][kKeySpan / 2] words; the tiles
// shaped for them, `lower` rows past the first 16) times the values of keys [0, num_keys) (vt, values_in_pairs;
// num_keys a multiple of 32), 32 dims at a time.
static inline void values_on_tiles(const uint32_t* pairs, int lower, const uint32_t* vt, int64_t num_keys,
                                   int64_t dim, float* acc) {
  const int64_t acc_stride = dim * 4, value_stride = dim * 4;
  constexpr int64_t kPairStride = kKeySpan / 2 * 4;
  const uint32_t* lower_pairs = pairs + kTileRegisterRows * (kKeySpan / 2);
  float* lower_acc = acc + kTileRegisterRows * dim;
  for (int64_t d = 0; d < dim; d += 32) {
    BS_TILE_LOAD(0, acc + d, acc_stride);
    BS_TILE_LOAD(1, acc + d + 16, acc_stride);
    if (lower > 0) {
      BS_TILE_LOAD(2, lower_acc + d, acc_stride);
      BS_TILE_LOAD(3, lower_acc + d + 16, acc_stride);
    }
    for (int64_t p = 0; p < num_keys / 2; p += 16) {
      BS_TILE_LOAD(6, vt + p * dim + d, value_stride);
      BS_TILE_LOAD(7, vt + p * dim + d + 16, value_stride);
      BS_TILE_LOAD(4, pairs + p, kPairStride);
      BS_TILE_DPBF16PS(0, 4, 6);
      BS_TILE_DPBF16PS(1, 4, 7);
      if (lower > 0) {
        BS_TILE_LOAD(5, lower_pairs + p, kPairStride);
        BS_TILE_DPBF16PS(2, 5, 6);
        BS_TILE_DPBF16PS(3, 5, 7);
      }
    }
    BS_TILE_STORE(0, acc + d, acc_stride);
    BS_TILE_STORE(1, acc + d + 16, acc_stride);
    if (lower > 0) {
      BS_TILE_STORE(2, lower_acc + d, acc_stride);
      BS_TILE_STORE(3, lower_acc + d + 16, acc_stride);
    }
  }
}

// One span of a one-head tile of several queries (attend_tile_with's kDot prefill branch): rows [first_row, rows)
// scored from the span's keys in lanes (in_lanes, lane_keys of them), their softmax updated 32 rows at a time
// (each pass's probabilities zero up to its most visible key rounded up to 32), and the values (values[j], j <
// span_keys) summed into the accumulators. in_lanes is rewritten with the values once the scores are done.
template <class Ahead>
static void attend_span_on_tiles(const AttentionTile<Bf16>& t, const HeadRows& head, int64_t span, int64_t span_keys,
                                 int64_t first_row, int64_t rows, int64_t lane_keys, const Bf16* const* values,
                                 uint32_t* in_lanes, float* scores, Ahead& ahead) {
  const int64_t dim = t.head_dim, row_words = dim / 2;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(head.q);
  AttentionTiles tiles;
  for (int64_t r = first_row; r < rows; r += kAmxAttentionRows) {
    const int count = static_cast<int>(rows - r < kAmxAttentionRows ? rows - r : kAmxAttentionRows);
    const int upper = count < kTileRegisterRows ? count : kTileRegisterRows;
    tiles.shape(upper, count - upper);
    scores_on_tiles(words + r * row_words, row_words, upper, count - upper, in_lanes, lane_keys, scores + r * kKeySpan,
                    ahead);
  }
  values_in_pairs(values, span_keys, dim, in_lanes);
  alignas(64) uint32_t pairs[kAmxAttentionRows][kKeySpan / 2];
  for (int64_t r = first_row; r < rows; r += kAmxAttentionRows) {
    const int count = static_cast<int>(rows - r < kAmxAttentionRows ? rows - r : kAmxAttentionRows);
    int64_t visible[kAmxAttentionRows];
    const int64_t most_visible = visible_keys(t, r, count, span, span_keys, visible);
    if (__builtin_expect(t.window > 0 || t.softcap > 0.0f, 0)) vary_scores(t, r, count, span, visible, scores);
    const int64_t pass_keys = (most_visible + 31) / 32 * 32;  // at most kKeySpan
    for (int i = 0; i < count; ++i) {
      float* row_scores = scores + (r + i) * kKeySpan;
      softmax_update(row_scores, visible[i], pass_keys, head.running_max + r + i, head.running_sum + r + i,
                     head.acc + (r + i) * dim, dim);
      to_bf16_pairs(row_scores, pass_keys, pairs[i]);
    }
    const int upper = count < kTileRegisterRows ? count : kTileRegisterRows;
    tiles.shape(upper, count - upper);
    values_on_tiles(&pairs[0][0], count - upper, in_lanes, pass_keys, dim, head.acc + r * dim);
  }
  tiles.release();
}
#endif
