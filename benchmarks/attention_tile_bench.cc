// The arithmetic of decode attention tiles, without the memory reads: bench_attention_tile.py builds this file into a
// small library beside the op library (whose kernel sets it calls through kernel_set.h) and times, on one thread,
// `tiles` decode tiles over rows few enough to stay in the core's L2, each tile attending `keys` keys of every kv
// head, as paged_attention's decode tiles do.
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_set.h"

namespace {

// The kernel set named `name` (avx2, avx512, avx512_bf16, amx) if the CPU runs it, else null.
const bs::KernelSet* kernel_set(const char* name) {
  using bs::kAllowAmx;
  using bs::kAllowAvx512;
  using bs::kAllowAvx512Bf16;
  using bs::kAllowAvx512Vnni;
  const int dots = kAllowAvx512 | kAllowAvx512Bf16 | kAllowAvx512Vnni;
  struct Named {
    const char* name;
    int allowed;
    const bs::KernelSet& (*set)();
  };
  const Named sets[] = {{"avx2", 0, bs::avx2_kernels},
                        {"avx512", kAllowAvx512, bs::avx512_kernels},
                        {"avx512_bf16", dots, bs::avx512_bf16_kernels},
                        {"amx", dots | kAllowAmx, bs::amx_kernels}};
  for (const Named& named : sets) {
    if (std::strcmp(named.name, name) != 0) continue;
    const bs::KernelSet& chosen = bs::kernels_for(bs::allowed_isa(named.allowed));
    return &chosen == &named.set() ? &chosen : nullptr;  // a CPU without the set gets the one below it
  }
  return nullptr;
}

struct Shape {
  int tiles, keys, heads, kv_heads, head_dim, block_size;
};

// Values in [-1, 1) from a fixed sequence (the same for every cache and kernel set).
struct Values {
  uint32_t state = 1;
  float next() {
    state = state * 1103515245u + 12345u;
    return static_cast<float>((state >> 8) % 2000) / 1000.0f - 1.0f;
  }
};

// One cache dtype's tiles, caches and output.
struct DtypeTiles {
  virtual ~DtypeTiles() = default;
  virtual void attend() = 0;  // every tile once
  virtual const float* last_out() const = 0;
};

template <class T>
struct TypedTiles : DtypeTiles {
  const bs::KvKernels<T>& cache_kernels;
  std::vector<T> key_cache, value_cache;
  std::vector<int64_t> table;
  std::vector<float> query, out, scratch;
  std::vector<bs::AttentionTile<T>> tiles;
  int64_t out_floats;

  TypedTiles(const bs::KernelSet& kernels, const Shape& shape) : cache_kernels(kernels.for_cache<T>()) {
    const int64_t row = bs::kv_row_elements<T>(shape.head_dim);
    const int64_t blocks_each = (shape.keys + shape.block_size - 1) / shape.block_size;
    const int64_t num_blocks = shape.tiles * blocks_each;
    const int64_t num_rows = num_blocks * shape.block_size * shape.kv_heads;
    key_cache.resize(num_rows * row), value_cache.resize(num_rows * row);
    std::vector<float> x(shape.head_dim);
    Values values;
    for (int64_t r = 0; r < num_rows; ++r) {
      for (float& v : x) v = values.next();
      cache_kernels.store(x.data(), key_cache.data() + r * row, shape.head_dim, 1);
      for (float& v : x) v = values.next();
      cache_kernels.store(x.data(), value_cache.data() + r * row, shape.head_dim, 1);
    }
    const bool in_groups =
        std::is_same_v<T, bs::Int8> && bs::int8_cache_in_groups(kernels, shape.block_size, shape.head_dim);
    if constexpr (std::is_same_v<T, bs::Int8>) {  // the same rows, in groups, as the kernel set keeps them
      if (in_groups) {
        Values again;
        std::vector<float> keys(shape.kv_heads * shape.head_dim), values_of_slot(keys.size());
        const std::vector<float> cos(shape.head_dim, 1.0f), sin(shape.head_dim, 0.0f);  // no rotation
        for (int64_t slot = 0; slot < num_rows / shape.kv_heads; ++slot) {
          for (int64_t h = 0; h < shape.kv_heads; ++h) {
            for (int64_t d = 0; d < shape.head_dim; ++d) keys[h * shape.head_dim + d] = again.next();
            for (int64_t d = 0; d < shape.head_dim; ++d) values_of_slot[h * shape.head_dim + d] = again.next();
          }
          kernels.write_int8_groups(keys.data(), values_of_slot.data(), cos.data(), sin.data(), slot, key_cache.data(),
                                    value_cache.data(), shape.kv_heads, shape.head_dim);
        }
      }
    }
    table.resize(num_blocks);
    for (int64_t b = 0; b < num_blocks; ++b) table[b] = b;
    out_floats = static_cast<int64_t>(shape.heads) * shape.head_dim;
    query.resize(shape.tiles * out_floats), out.resize(query.size());
    for (float& v : query) v = values.next();
    scratch.resize(bs::attention_scratch_floats(1, shape.kv_heads, shape.heads / shape.kv_heads, shape.head_dim));
    tiles.resize(shape.tiles);
    for (int i = 0; i < shape.tiles; ++i) {
      // One query at position keys - 1, every kv head; the tile before asked for its first span (i > 0).
      tiles[i] = bs::AttentionTile<T>{query.data(), key_cache.data(), value_cache.data(),
                                      table.data() + i * blocks_each, out.data(), scratch.data(),
                                      i, 1, shape.keys - 1, 0, shape.kv_heads,
                                      shape.heads, shape.kv_heads, shape.head_dim, shape.block_size,
                                      1.0f / std::sqrt(static_cast<float>(shape.head_dim)), nullptr, i > 0,
                                      0, shape.keys, nullptr, 0, 0.0f};
    }
    for (int i = 0; i + 1 < shape.tiles; ++i) tiles[i].next = &tiles[i + 1];  // as a thread's next tile
    for (auto& tile : tiles) tile.int8_groups = in_groups;
  }
  void attend() override {
    for (const auto& tile : tiles) cache_kernels.attend_tile(tile);
  }
  const float* last_out() const override { return out.data() + (tiles.size() - 1) * out_floats; }
};

std::unique_ptr<DtypeTiles> tiles_of(const bs::KernelSet& kernels, const std::string& dtype, const Shape& shape) {
  if (dtype == "float32") return std::make_unique<TypedTiles<float>>(kernels, shape);
  if (dtype == "bfloat16") return std::make_unique<TypedTiles<bs::Bf16>>(kernels, shape);
  if (dtype == "int8") return std::make_unique<TypedTiles<bs::Int8>>(kernels, shape);
  if (dtype == "fp8_e4m3") return std::make_unique<TypedTiles<bs::Fp8E4M3>>(kernels, shape);
  return nullptr;
}

// Passes of one dtype in a row: its first pass after another dtype's finds its rows pushed out of the core's L2 by
// theirs, and is rarely the fastest.
constexpr int kTurn = 20;

}  // namespace

// For each cache dtype of `cache_dtypes` (names separated by commas): ns[i], the nanoseconds per tile of its fastest
// pass over the tiles, the dtypes taking turns of kTurn passes until `reps` passes each (a slow moment of a shared
// host falls on all of them alike), and outs[i * heads * head_dim...], its last tile's output. Returns 0, -1 if the
// CPU does not run `kernels`, -2 for an unknown dtype.
extern "C" int bs_time_decode_tiles(const char* kernels, const char* cache_dtypes, int tiles, int keys, int reps,
                                    int heads, int kv_heads, int head_dim, int block_size, double* ns, float* outs) {
  const bs::KernelSet* set = kernel_set(kernels);
  if (set == nullptr) return -1;
  const Shape shape{tiles, keys, heads, kv_heads, head_dim, block_size};
  std::vector<std::unique_ptr<DtypeTiles>> timed;
  std::string names = cache_dtypes;
  for (size_t start = 0; start <= names.size();) {
    const size_t comma = std::min(names.find(',', start), names.size());
    timed.push_back(tiles_of(*set, names.substr(start, comma - start), shape));
    if (timed.back() == nullptr) return -2;
    start = comma + 1;
  }
  std::vector<double> best(timed.size(), 1e30);
  for (int r = 0; r < reps; r += kTurn) {
    for (size_t i = 0; i < timed.size(); ++i) {
      for (int pass = r; pass < std::min(reps, r + kTurn); ++pass) {
        const auto started = std::chrono::steady_clock::now();
        timed[i]->attend();
        best[i] = std::min(best[i], std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
      }
    }
  }
  const int64_t out_floats = static_cast<int64_t>(heads) * head_dim;
  for (size_t i = 0; i < timed.size(); ++i) {
    ns[i] = best[i] / tiles * 1e9;
    std::copy(timed[i]->last_out(), timed[i]->last_out() + out_floats, outs + i * out_floats);
  }
  return 0;
}
