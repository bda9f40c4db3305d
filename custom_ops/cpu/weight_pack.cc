#include "weight_pack.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace bs::linear {
namespace {

// GGUF's blocks of 32 values: bytes of one block and where its quants start.
struct GgufBlock {
  int64_t bytes, quants_offset;
};

GgufBlock gguf_block(Format format) {
  switch (format) {
    case Format::kQ8_0:
      return {34, 2};
    case Format::kQ4_0:
      return {18, 2};
    default:  // Q4_1
      return {20, 4};
  }
}

// Bytes of a packed Q block before its quants: f16 d[16] (and f16 m[16] for Q4_1).
int64_t scale_bytes(Format format) { return format == Format::kQ4_1 ? 64 : 32; }

uint16_t load_u16(const uint8_t* p) {
  uint16_t value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

uint32_t load_u32(const uint8_t* p) {
  uint32_t value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

void store_u32(uint8_t* p, uint32_t value) { std::memcpy(p, &value, sizeof value); }

uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if (std::isnan(value)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float from_bf16(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// IEEE half -> float without F16C (this file is baseline code).
float from_f16(uint16_t half) {
  const uint32_t sign = (half >> 15) & 1, exponent = (half >> 10) & 0x1f, mantissa = half & 0x3ff;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  }
  return sign ? -magnitude : magnitude;
}

// Value e (0..31) of a GGUF Q4 block's 16 quant bytes: low nibbles hold 0..15, high nibbles 16..31.
uint32_t q4_value(const uint8_t* quants, int e) { return e < 16 ? quants[e] & 0xf : quants[e - 16] >> 4; }

}  // namespace

void pack_float(Format format, const float* w, int64_t k, int64_t n, uint8_t* packed) {
  const int64_t panels = num_panels(n), bytes = panel_bytes(format, k), blocks = num_blocks(format, k);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint8_t* panel = packed + p * bytes;
    std::memset(panel, 0, bytes);
    const int64_t cols = std::min<int64_t>(kPanelWidth, n - p * kPanelWidth);
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = panel + b * 64;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t column = p * kPanelWidth + c;
        if (format == Format::kF32) {
          std::memcpy(block + 4 * c, w + b * n + column, sizeof(float));
        } else {
          const uint32_t even = to_bf16(w[2 * b * n + column]);
          const uint32_t odd = 2 * b + 1 < k ? to_bf16(w[(2 * b + 1) * n + column]) : 0;
          store_u32(block + 4 * c, even | odd << 16);
        }
      }
    }
  }
}

void pack_int8(const int8_t* q, const float* scales, int64_t k, int64_t n, uint8_t* packed) {
  const int64_t panels = num_panels(n), bytes = panel_bytes(Format::kInt8, k);
  const int64_t header = geometry(Format::kInt8).header_bytes;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint8_t* panel = packed + p * bytes;
    std::memset(panel, 0, bytes);
    const int64_t cols = std::min<int64_t>(kPanelWidth, n - p * kPanelWidth);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t column = p * kPanelWidth + c;
      std::memcpy(panel + 4 * c, scales + column, sizeof(float));
      for (int64_t row = 0; row < (k + 3) / 4 * 4; ++row) {  // padding rows hold q = 0
        const int value = row < k ? q[row * n + column] : 0;
        panel[header + (row / 4) * 64 + 4 * c + row % 4] = static_cast<uint8_t>(value + 128);
      }
    }
  }
}

int64_t gguf_row_bytes(Format format, int64_t k) { return k / 32 * gguf_block(format).bytes; }

void pack_gguf(Format format, const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, uint8_t* packed) {
  const GgufBlock source = gguf_block(format);
  const int64_t panels = num_panels(n), bytes = panel_bytes(format, k), blocks = k / 32;
  const int64_t block_bytes = geometry(format).block_bytes, quants = scale_bytes(format);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint8_t* panel = packed + p * bytes;
    std::memset(panel, 0, bytes);  // columns past n: zero scales, zero weights
    const int64_t cols = std::min<int64_t>(kPanelWidth, n - p * kPanelWidth);
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = panel + b * block_bytes;
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t* from = rows + (p * kPanelWidth + c) * row_bytes + b * source.bytes;
        std::memcpy(block + 2 * c, from, 2);                                     // d
        if (format == Format::kQ4_1) std::memcpy(block + 32 + 2 * c, from + 2, 2);  // m
        const uint8_t* values = from + source.quants_offset;
        if (format == Format::kQ8_0) {
          for (int e = 0; e < 32; ++e) {
            block[quants + (e / 4) * 64 + 4 * c + e % 4] = static_cast<uint8_t>(static_cast<int8_t>(values[e]) + 128);
          }
          continue;
        }
        for (int g = 0; g < 4; ++g) {
          for (int j = 0; j < 4; ++j) {
            const uint32_t pair = q4_value(values, 8 * g + j) | q4_value(values, 8 * g + 4 + j) << 4;
            block[quants + g * 64 + 4 * c + j] = static_cast<uint8_t>(pair);
          }
        }
      }
    }
  }
}

void unpack_column(Format format, const uint8_t* packed, int64_t k, int64_t column, float* out) {
  const Geometry g = geometry(format);
  const uint8_t* panel = packed + (column / kPanelWidth) * panel_bytes(format, k);
  const int64_t c = column % kPanelWidth;
  for (int64_t row = 0; row < k; ++row) {
    const uint8_t* block = panel + g.header_bytes + (row / g.block_k) * g.block_bytes;
    const int64_t e = row % g.block_k;
    switch (format) {
      case Format::kF32:
        std::memcpy(out + row, block + 4 * c, sizeof(float));
        break;
      case Format::kBF16:
        out[row] = from_bf16(static_cast<uint16_t>(load_u32(block + 4 * c) >> (16 * e)));
        break;
      case Format::kInt8: {
        float scale;
        std::memcpy(&scale, panel + 4 * c, sizeof scale);
        out[row] = static_cast<float>(block[4 * c + e] - 128) * scale;
        break;
      }
      case Format::kQ8_0:
        out[row] = from_f16(load_u16(block + 2 * c)) * static_cast<float>(block[32 + (e / 4) * 64 + 4 * c + e % 4] - 128);
        break;
      case Format::kQ4_0:
      case Format::kQ4_1: {
        const float d = from_f16(load_u16(block + 2 * c));
        const uint8_t pair = block[scale_bytes(format) + (e / 8) * 64 + 4 * c + e % 4];
        const float q = static_cast<float>(e % 8 < 4 ? pair & 0xf : pair >> 4);
        out[row] = format == Format::kQ4_0 ? d * (q - 8.0f) : d * q + from_f16(load_u16(block + 32 + 2 * c));
        break;
      }
    }
  }
}

void unpack_columns(Format format, const uint8_t* packed, int64_t k, const int64_t* columns, int64_t count,
                    float* out) {
#pragma omp parallel for schedule(static) if (count > 16)
  for (int64_t i = 0; i < count; ++i) unpack_column(format, packed, k, columns[i], out + i * k);
}

}  // namespace bs::linear
