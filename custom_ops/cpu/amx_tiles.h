// AMX tiles for the GEMM micro-kernels of linear_amx_bf16.h and linear_amx_int8.h and the prefill attention of
// attention_amx.h: the tile configuration (ldtilecfg's 64-byte palette 1) and the tile instructions as inline
// assembly, or, in the tests' build with BS_AMX_EMULATION, as amx_emulation.h's C++. Included inside an AMX region
// (linear_gemm.cc, kernels_amx.cc); no include guard, nothing from the standard library.
//
// GCC's own intrinsics (amxtileintrin.h) tell the compiler neither that tileloadd reads memory nor that
// tilestored writes it, and _tile_loadconfig reads its 64 bytes through an 8-byte operand: stores to a buffer
// a tile then loads, or reads of what a tile stored, could be moved across them. Here every tile instruction
// that touches memory clobbers "memory". Tile registers are named in the instruction, so they are macros.

// Palette 1: up to 16 rows of up to 64 bytes per tile register.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of each tile register
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

constexpr int kTileRegisterRows = 16;  // rows of a tile register, at most

#ifndef BS_AMX_EMULATION
#define BS_TILE_LOAD_CONFIG(config) asm volatile("ldtilecfg %0" ::"m"(config) : "memory")
#define BS_TILE_STORE_CONFIG(config) asm volatile("sttilecfg %0" : "=m"(config)::"memory")
#define BS_TILE_RELEASE() asm volatile("tilerelease" ::: "memory")
#define BS_TILE_ZERO(tmm) asm volatile("tilezero %%tmm" #tmm ::)
#define BS_TILE_LOAD(tmm, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define BS_TILE_STORE(tmm, base, stride) \
  asm volatile("tilestored %%tmm" #tmm ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
// c += a . b: tdpbf16ps (bf16 pairs, fp32 sums), tdpbsud (signed bytes of a, unsigned bytes of b, int32 sums).
#define BS_TILE_DPBF16PS(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define BS_TILE_DPBSUD(c, a, b) asm volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#else
#include "amx_emulation.h"
#endif

static inline TileConfig empty_tile_config() {
  TileConfig config;
  __builtin_memset(&config, 0, sizeof config);
  config.palette = 1;
  return config;
}

static inline void set_tile(TileConfig& config, int tile, int rows, int row_bytes) {
  config.rows[tile] = static_cast<uint8_t>(rows);
  config.colsb[tile] = static_cast<uint16_t>(row_bytes);
}

static inline void load_tile_config(const TileConfig& config) { BS_TILE_LOAD_CONFIG(config); }

// Loads `config` unless the thread's tiles are configured so already (sttilecfg reads the current configuration:
// 64 zero bytes where none is loaded or the tiles were released): for configurations loaded now and then (a GEMM's
// per thread, the attention's per change of shape), not per tile. sttilecfg waits for the tile products before it;
// checked per 32 x 32 tile it still cost a 512 x 576 x 960 bf16 product about a quarter of its time on one thread
// (Emerald Rapids), loading per tile more.
static inline void configure_tiles(const TileConfig& config) {
  TileConfig current;
  BS_TILE_STORE_CONFIG(current);
  if (__builtin_memcmp(&current, &config, sizeof config) != 0) load_tile_config(config);
}

// Loads the register plan of the GEMMs' and the attention's tile products, C[rows][16] += A[rows][k] . B[k][16] over an
// upper and a lower block of rows and `blocks` (1 or 2) column blocks: tmm0..3 the sums of (upper | lower rows) x
// (block 0 | 1), tmm(2 * half + block), 64 bytes a row; tmm4, tmm5 the upper and lower rows' A, a_row_bytes a row;
// tmm6, tmm7 the B of block 0 and 1, b_rows rows of 64 bytes. No lower rows: tmm2, tmm3 and tmm5 stay unconfigured.
// Loaded only where the thread's tiles are configured otherwise (configure_tiles); the caller zeroes its sums.
static inline void load_row_block_tiles(int upper, int lower, int blocks, int a_row_bytes, int b_rows) {
  TileConfig config = empty_tile_config();
  for (int block = 0; block < blocks; ++block) {
    set_tile(config, block, upper, 64);
    if (lower > 0) set_tile(config, 2 + block, lower, 64);
    set_tile(config, 6 + block, b_rows, 64);
  }
  set_tile(config, 4, upper, a_row_bytes);
  if (lower > 0) set_tile(config, 5, lower, a_row_bytes);
  configure_tiles(config);
}
static inline void release_tiles() { BS_TILE_RELEASE(); }

// The GEMMs' register plan at its largest (16 upper and 16 lower rows, two column blocks), which a thread configures
// once per GEMM: a tile of fewer rows multiplies 16 (or 32) rows of x all the same, past its last row into the
// scratch's kAmxRows rows of slack, and stores only its own rows; a tile of one panel leaves tmm7 unused. No tile
// call configures tiles then: sttilecfg and ldtilecfg wait for the tile products before them, and configuring the
// tiles of each 32 x 32 tile of a 512 x 576 x 960 bf16 product cost about a quarter of its time on one thread
// (Emerald Rapids).
static inline void load_gemm_tiles(int a_row_bytes, int b_rows) {
  load_row_block_tiles(kTileRegisterRows, kTileRegisterRows, 2, a_row_bytes, b_rows);
}

