// The packed weight formats of the linear layers. Every format stores W[k, n] (y = x @ W) as
// 16-column panels; a panel is a header, then blocks of `block_k` input rows, each block holding
// all 16 columns so that the GEMM reads one panel front to back. Format ids are GGML's type ids
// where GGML has the format (gpu_worker/weight_format.py names the same ids).
//
// Block layouts (c = column in the panel, lanes are 32 bits, one per column). Every lane holds
// consecutive rows k of its column, so that one lane is an operand of vpdpbusd (four unsigned bytes)
// as it is; 8-bit values are stored with 128 added (unsigned), 4-bit ones as they are:
//   F32   float[16]                                             w[k0][c]
//   BF16  lane c = bf16 w[k0][c] | bf16 w[k0 + 1][c] << 16
//   INT8  lane c = bytes q[k0 + j][c] + 128, j = 0..3; header: float scale[16];   w = q * scale[c]
//   Q8_0  f16 d[16]; 8 groups g: lane c = bytes q[k0 + 4g + j][c] + 128;         w = d[c] * q
//   Q4_0  f16 d[16]; 4 groups g: lane c = byte j holds q[k0 + 8g + j][c] in its low nibble and
//         q[k0 + 8g + 4 + j][c] in its high nibble;                              w = d[c] * (q - 8)
//   Q4_1  f16 d[16], f16 m[16]; 4 groups as Q4_0;                               w = d[c] * q + m[c]
// The Q formats are GGUF's blocks of 32 (scales per column and block) regrouped, not re-quantized.
#pragma once

#include <cstdint>

namespace bs::linear {

constexpr int kPanelWidth = 16;  // output columns per panel

enum class Format : int { kF32 = 0, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kBF16 = 30, kInt8 = 256 };

struct Geometry {
  int64_t block_k;       // input rows per block
  int64_t block_bytes;   // bytes of one block (all 16 columns)
  int64_t header_bytes;  // bytes before a panel's first block
};

inline bool is_format(int id) {
  switch (static_cast<Format>(id)) {
    case Format::kF32:
    case Format::kBF16:
    case Format::kInt8:
    case Format::kQ8_0:
    case Format::kQ4_0:
    case Format::kQ4_1:
      return true;
  }
  return false;
}

constexpr Geometry geometry(Format format) {
  switch (format) {
    case Format::kF32:
      return {1, 64, 0};
    case Format::kBF16:
      return {2, 64, 0};
    case Format::kInt8:
      return {4, 64, 64};
    case Format::kQ8_0:
      return {32, 32 + 8 * 64, 0};
    case Format::kQ4_0:
      return {32, 32 + 4 * 64, 0};
    case Format::kQ4_1:
      return {32, 64 + 4 * 64, 0};
  }
  return {1, 64, 0};
}

inline bool is_gguf_block(Format format) { return geometry(format).block_k == 32; }

inline int64_t num_panels(int64_t n) { return (n + kPanelWidth - 1) / kPanelWidth; }

// Blocks per panel: k rounded up to whole blocks (the padding rows hold zero weights).
inline int64_t num_blocks(Format format, int64_t k) {
  const int64_t block_k = geometry(format).block_k;
  return (k + block_k - 1) / block_k;
}

inline int64_t panel_bytes(Format format, int64_t k) {
  const Geometry g = geometry(format);
  return g.header_bytes + num_blocks(format, k) * g.block_bytes;
}

}  // namespace bs::linear
