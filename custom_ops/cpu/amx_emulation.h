// AMX's tile instructions emulated in C++, for tests on CPUs without AMX: amx_tiles.h includes this in place of its
// inline assembly where BS_AMX_EMULATION is defined. Only a test build defines it (custom_ops/build.py, under
// BLOCKSERVE_TEST_AMX_EMULATION); isa.h then reports AMX on any CPU with the rest of the AMX kernel set's
// instructions (AVX512-BF16, AVX512-VNNI, AVX512-VBMI), so that every AMX code path runs against the tests'
// NumPy references. It checks what the hardware checks: a tile instruction on a tile that is not configured, or
// on tiles whose shapes do not fit together, is a trap (the hardware's #UD), and so is a configuration that palette
// 1 cannot hold (#GP). It computes as Intel's pseudocode (SDM vol. 2, TDPBF16PS and TDPBSUD): for each row m, each
// k and each column n, tdpbf16ps adds the two products of a bf16 pair one after the other in fp32, rounding to
// nearest even, inputs and results flushed to zero where denormal; tdpbsud adds the 4 products of signed bytes of
// a and unsigned bytes of b to an int32, wrapping. Its sums therefore match the hardware's to fp32 rounding, not
// bit for bit; the tests compare the AMX paths with tolerances, as on the hardware. Each namespace that includes
// amx_tiles.h has its own tile state per thread, as each only runs its own tile products after configuring them.
// Included by amx_tiles.h only; no include guard, nothing from the standard library.

struct EmulatedTiles {
  TileConfig config;  // all zero: no configuration loaded (palette 0)
  alignas(64) uint8_t data[8][kTileRegisterRows][64];
};
static thread_local EmulatedTiles emulated_tiles;

static inline void emulated_release_tiles() { __builtin_memset(&emulated_tiles, 0, sizeof emulated_tiles); }

// ldtilecfg: palette 0 releases the tiles; palette 1 holds 8 tiles of up to 16 rows of up to 64 bytes, from row 0.
static inline void emulated_load_tile_config(const TileConfig& config) {
  if (config.palette == 0) return emulated_release_tiles();
  if (config.palette != 1 || config.start_row != 0) __builtin_trap();
  for (int i = 0; i < 14; ++i) {
    if (config.reserved[i] != 0) __builtin_trap();
  }
  for (int t = 0; t < 16; ++t) {
    const bool beyond = t >= 8 && (config.rows[t] != 0 || config.colsb[t] != 0);
    if (beyond || config.rows[t] > kTileRegisterRows || config.colsb[t] > 64) __builtin_trap();
  }
  __builtin_memset(&emulated_tiles, 0, sizeof emulated_tiles);
  __builtin_memcpy(&emulated_tiles.config, &config, sizeof config);
}

static inline void emulated_store_tile_config(TileConfig& config) {
  __builtin_memcpy(&config, &emulated_tiles.config, sizeof config);
}

// A configured tile's rows and bytes a row; a trap where the tiles are not configured or this one is empty.
static inline void emulated_tile_shape(int tile, int& rows, int& row_bytes) {
  const TileConfig& config = emulated_tiles.config;
  rows = config.rows[tile], row_bytes = config.colsb[tile];
  if (config.palette != 1 || rows == 0 || row_bytes == 0) __builtin_trap();
}

static inline void emulated_tile_zero(int tile) {
  int rows = 0, row_bytes = 0;
  emulated_tile_shape(tile, rows, row_bytes);
  __builtin_memset(emulated_tiles.data[tile], 0, sizeof emulated_tiles.data[tile]);
}

// tileloadd: the configured rows and bytes from base, stride bytes apart; the rest of the register zeroed.
static inline void emulated_tile_load(int tile, const void* base, long stride) {
  int rows = 0, row_bytes = 0;
  emulated_tile_shape(tile, rows, row_bytes);
  __builtin_memset(emulated_tiles.data[tile], 0, sizeof emulated_tiles.data[tile]);
  const char* from = static_cast<const char*>(base);
  for (int r = 0; r < rows; ++r) __builtin_memcpy(emulated_tiles.data[tile][r], from + r * stride, row_bytes);
}

static inline void emulated_tile_store(int tile, void* base, long stride) {
  int rows = 0, row_bytes = 0;
  emulated_tile_shape(tile, rows, row_bytes);
  char* to = static_cast<char*>(base);
  for (int r = 0; r < rows; ++r) __builtin_memcpy(to + r * stride, emulated_tiles.data[tile][r], row_bytes);
}

// The shapes of c += a . b: c is M rows of N 4-byte sums, a M rows of K 4-byte groups, b K rows of N 4-byte groups
// (tdpbf16ps's and tdpbsud's #UD conditions). Gives M, K and N.
static inline void emulated_product_shape(int c, int a, int b, int& m, int& k, int& n) {
  int c_rows = 0, c_bytes = 0, a_rows = 0, a_bytes = 0, b_rows = 0, b_bytes = 0;
  emulated_tile_shape(c, c_rows, c_bytes);
  emulated_tile_shape(a, a_rows, a_bytes);
  emulated_tile_shape(b, b_rows, b_bytes);
  if (c_bytes % 4 != 0 || a_bytes % 4 != 0 || b_rows != a_bytes / 4 || c_bytes != b_bytes || c_rows != a_rows) {
    __builtin_trap();
  }
  m = c_rows, k = a_bytes / 4, n = c_bytes / 4;
}

static inline float emulated_flush_denormal(float x) {
  return __builtin_fabsf(x) < 0x1p-126f ? __builtin_copysignf(0.0f, x) : x;
}

static inline float emulated_bf16_to_float(const uint8_t* pair, int i) {
  uint16_t bits;
  __builtin_memcpy(&bits, pair + 2 * i, sizeof bits);
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float x;
  __builtin_memcpy(&x, &word, sizeof x);
  return emulated_flush_denormal(x);
}

// c += a . b, the tiles' shapes checked: each of c's 4-byte sums (Sum) of row m and column n updated by
// add(sum, a's 4 bytes at [m][k], b's 4 bytes at [k][n]) for k in order; the bytes past c's columns zeroed.
template <class Sum, class Add>
static inline void emulated_tile_product(int c, int a, int b, Add add) {
  int rows = 0, depth = 0, cols = 0;
  emulated_product_shape(c, a, b, rows, depth, cols);
  for (int m = 0; m < rows; ++m) {
    Sum sums[16];
    __builtin_memcpy(sums, emulated_tiles.data[c][m], sizeof sums);
    for (int k = 0; k < depth; ++k) {
      const uint8_t* x = emulated_tiles.data[a][m] + 4 * k;
      for (int n = 0; n < cols; ++n) sums[n] = add(sums[n], x, emulated_tiles.data[b][k] + 4 * n);
    }
    __builtin_memset(emulated_tiles.data[c][m], 0, sizeof emulated_tiles.data[c][m]);
    __builtin_memcpy(emulated_tiles.data[c][m], sums, 4 * cols);
  }
}

static inline void emulated_tile_dpbf16ps(int c, int a, int b) {
  emulated_tile_product<float>(c, a, b, [](float sum, const uint8_t* x, const uint8_t* y) {
    // A product of two bf16 is exact in fp32 (16 significant bits): only the sums round.
    const float first = emulated_flush_denormal(emulated_bf16_to_float(x, 0) * emulated_bf16_to_float(y, 0));
    const float second = emulated_flush_denormal(emulated_bf16_to_float(x, 1) * emulated_bf16_to_float(y, 1));
    return emulated_flush_denormal(emulated_flush_denormal(sum + first) + second);
  });
}

static inline void emulated_tile_dpbsud(int c, int a, int b) {
  emulated_tile_product<uint32_t>(c, a, b, [](uint32_t sum, const uint8_t* x, const uint8_t* y) {
    int32_t dot = 0;
    for (int i = 0; i < 4; ++i) dot += static_cast<int32_t>(static_cast<int8_t>(x[i])) * static_cast<int32_t>(y[i]);
    return sum + static_cast<uint32_t>(dot);  // wrapping, as the hardware's int32 sums
  });
}

#define BS_TILE_LOAD_CONFIG(config) emulated_load_tile_config(config)
#define BS_TILE_STORE_CONFIG(config) emulated_store_tile_config(config)
#define BS_TILE_RELEASE() emulated_release_tiles()
#define BS_TILE_ZERO(tmm) emulated_tile_zero(tmm)
#define BS_TILE_LOAD(tmm, base, stride) emulated_tile_load(tmm, base, static_cast<long>(stride))
#define BS_TILE_STORE(tmm, base, stride) emulated_tile_store(tmm, base, static_cast<long>(stride))
#define BS_TILE_DPBF16PS(c, a, b) emulated_tile_dpbf16ps(c, a, b)
#define BS_TILE_DPBSUD(c, a, b) emulated_tile_dpbsud(c, a, b)
