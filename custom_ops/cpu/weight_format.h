// The packed weight formats of the linear layers: one row each (FormatTraits<format>), as llama.cpp keeps one
// row per type: the block geometry, the dot product a micro-kernel may feed the blocks to as they are stored,
// what the format is packed from and how (pack), and how a value is read back (value). A new format is an id
// in Format and Formats, a row here, and its decoder in each GEMM micro-kernel that reads it (linear_tile.h
// for every format; linear_vnni.h where kDot is Dot::kInt8). Format ids are GGML's type ids where GGML has
// the format (worker/layers/weight_format.py names the same ids; tests/unit/test_custom_op_ids.py checks them).
//
// Every format stores W[k, n] (y = x @ W) as 16-column panels; a panel is a header, then blocks of `block_k`
// input rows, each block holding all 16 columns so that the GEMM reads one panel front to back.
// Block layouts (c = column in the panel, lanes are 32 bits, one per column). Every lane holds consecutive
// rows k of its column, so that one lane is an operand of vpdpbusd (four unsigned bytes) as it is; 8-bit
// values are stored with 128 added (unsigned), 4-bit ones as they are:
//   F32   float[16]                                             w[k0][c]
//   BF16  lane c = bf16 w[k0][c] | bf16 w[k0 + 1][c] << 16
//   INT8  lane c = bytes q[k0 + j][c] + 128, j = 0..3; header: float scale[16];   w = q * scale[c]
//   Q8_0  f16 d[16]; 8 groups g: lane c = bytes q[k0 + 4g + j][c] + 128;         w = d[c] * q
//   Q4_0  f16 d[16]; 4 groups g: lane c = byte j holds q[k0 + 8g + j][c] in its low nibble and
//         q[k0 + 8g + 4 + j][c] in its high nibble;                              w = d[c] * (q - 8)
//   Q4_1  f16 d[16], f16 m[16]; 4 groups as Q4_0;                               w = d[c] * q + m[c]
// The Q formats are GGUF's blocks of 32 (scales per column and block) regrouped, not re-quantized.
// Plain C++ (also included before the instruction-set regions of linear_gemm.cc): the rows' pack and value
// are baseline code, run once at load or per looked-up token.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace bs::linear {

constexpr int kPanelWidth = 16;  // output columns per panel

enum class Format : int { kF32 = 0, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kBF16 = 30, kInt8 = 256 };

template <Format... kFormats>
struct FormatList {};
// Every format of the table: what visit_format dispatches over.
using Formats = FormatList<Format::kF32, Format::kBF16, Format::kInt8, Format::kQ8_0, Format::kQ4_0, Format::kQ4_1>;

struct Geometry {
  int64_t block_k;       // input rows per block
  int64_t block_bytes;   // bytes of one block (all 16 columns)
  int64_t header_bytes;  // bytes before a panel's first block
};

// The dot product whose operands a format's blocks are as stored (llama.cpp's vec_dot_type): kF32 none (the
// values are widened to fp32), kBf16 vdpbf16ps (bf16 pairs), kInt8 vpdpbusd (unsigned bytes times int8 x).
enum class Dot { kF32, kBf16, kInt8 };

// What a format is packed from: the Source of its row, the input of one bs_linear_pack* op.
struct DenseWeights {  // bs_linear_pack: w[k, n] fp32, row-major
  const float* w;
  int64_t n;
};
struct Int8Weights {  // bs_linear_pack_int8: q[k, n] int8 (row-major) and one scale per column
  const int8_t* q;
  const float* scales;
  int64_t n;
};
struct GgufRows {  // bs_linear_pack_gguf: GGUF blocks as stored, one row of k / 32 blocks per column
  const uint8_t* rows;
  int64_t row_bytes;
};

namespace codec {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

inline float load_f32(const uint8_t* p) {
  float value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if (std::isnan(value)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline float from_bf16(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// IEEE half -> float without F16C (baseline code).
inline float from_f16(uint16_t half) {
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

// Block b of a panel (`panel` points at its header).
inline uint8_t* block_of(const Geometry& g, uint8_t* panel, int64_t b) {
  return panel + g.header_bytes + b * g.block_bytes;
}
inline const uint8_t* block_of(const Geometry& g, const uint8_t* panel, int64_t b) {
  return panel + g.header_bytes + b * g.block_bytes;
}

}  // namespace codec

// One row per format:
//   kGeometry, kDot, Source       as above
//   kAsksFromOneRow               whether the GEMM's tiles ask for the next panel from one row of x (linear_vnni.h
//                                 has the measurements)
//   pack(source, k, column, b, panel, c)  writes column c of block b of a zeroed panel (and its part of the header)
//                                 from the source's column `column`; rows past k are zero weights
//   value(panel, c, row)          W[row, column c of the panel] in fp32
template <Format kFormat>
struct FormatTraits;

template <>
struct FormatTraits<Format::kF32> {
  static constexpr Geometry kGeometry{1, 64, 0};
  static constexpr Dot kDot = Dot::kF32;
  static constexpr bool kAsksFromOneRow = false;
  using Source = DenseWeights;
  static void pack(const Source& source, int64_t, int64_t column, int64_t b, uint8_t* panel, int c) {
    std::memcpy(codec::block_of(kGeometry, panel, b) + 4 * c, source.w + b * source.n + column, sizeof(float));
  }
  static float value(const uint8_t* panel, int c, int64_t row) {
    return codec::load_f32(codec::block_of(kGeometry, panel, row) + 4 * c);
  }
};

template <>
struct FormatTraits<Format::kBF16> {  // bf16 rounded to nearest even
  static constexpr Geometry kGeometry{2, 64, 0};
  static constexpr Dot kDot = Dot::kBf16;
  static constexpr bool kAsksFromOneRow = false;
  using Source = DenseWeights;
  static void pack(const Source& source, int64_t k, int64_t column, int64_t b, uint8_t* panel, int c) {
    const uint32_t even = codec::to_bf16(source.w[2 * b * source.n + column]);
    const uint32_t odd = 2 * b + 1 < k ? codec::to_bf16(source.w[(2 * b + 1) * source.n + column]) : 0;
    const uint32_t lane = even | odd << 16;
    std::memcpy(codec::block_of(kGeometry, panel, b) + 4 * c, &lane, sizeof lane);
  }
  static float value(const uint8_t* panel, int c, int64_t row) {
    const uint32_t lane = codec::load_u32(codec::block_of(kGeometry, panel, row / 2) + 4 * c);
    return codec::from_bf16(static_cast<uint16_t>(lane >> (16 * (row % 2))));
  }
};

template <>
struct FormatTraits<Format::kInt8> {
  static constexpr Geometry kGeometry{4, 64, 64};
  static constexpr Dot kDot = Dot::kInt8;
  static constexpr bool kAsksFromOneRow = false;
  using Source = Int8Weights;
  static void pack(const Source& source, int64_t k, int64_t column, int64_t b, uint8_t* panel, int c) {
    if (b == 0) std::memcpy(panel + 4 * c, source.scales + column, sizeof(float));
    uint8_t* lane = codec::block_of(kGeometry, panel, b) + 4 * c;
    for (int64_t j = 0; j < 4; ++j) {  // padding rows hold q = 0
      const int64_t row = 4 * b + j;
      lane[j] = static_cast<uint8_t>((row < k ? source.q[row * source.n + column] : 0) + 128);
    }
  }
  static float value(const uint8_t* panel, int c, int64_t row) {
    const uint8_t* lane = codec::block_of(kGeometry, panel, row / 4) + 4 * c;
    return static_cast<float>(lane[row % 4] - 128) * codec::load_f32(panel + 4 * c);
  }
};

// GGUF's blocks of 32 values, regrouped: a GGUF block of kSourceBytes holds f16 d (Q4_1: and f16 m), then
// its quants from byte kQuantsOffset; a packed block holds the 16 columns' d (and m) in its first kScaleBytes.
template <int64_t kSourceBytes, int64_t kQuantsOffset, int64_t kScaleBytes>
struct GgufBlockFormat {
  static constexpr Dot kDot = Dot::kInt8;
  static constexpr bool kAsksFromOneRow = true;
  using Source = GgufRows;
  static constexpr int64_t kQuants = kScaleBytes;  // where a packed block's quants start
  // Bytes of one GGUF row of k values (k a multiple of 32).
  static int64_t row_bytes(int64_t k) { return k / 32 * kSourceBytes; }
  // Block b of the source's column `column`; copies its scales into the packed block, returns its quants.
  static const uint8_t* scales_packed(const Source& source, int64_t column, int64_t b, uint8_t* block, int c) {
    const uint8_t* from = source.rows + column * source.row_bytes + b * kSourceBytes;
    std::memcpy(block + 2 * c, from, 2);                                       // d
    if (kScaleBytes == 64) std::memcpy(block + 32 + 2 * c, from + 2, 2);       // m
    return from + kQuantsOffset;
  }
};

template <>
struct FormatTraits<Format::kQ8_0> : GgufBlockFormat<34, 2, 32> {
  static constexpr Geometry kGeometry{32, 32 + 8 * 64, 0};
  static void pack(const Source& source, int64_t, int64_t column, int64_t b, uint8_t* panel, int c) {
    uint8_t* block = codec::block_of(kGeometry, panel, b);
    const uint8_t* values = scales_packed(source, column, b, block, c);
    for (int e = 0; e < 32; ++e) {
      block[kQuants + (e / 4) * 64 + 4 * c + e % 4] = static_cast<uint8_t>(static_cast<int8_t>(values[e]) + 128);
    }
  }
  static float value(const uint8_t* panel, int c, int64_t row) {
    const uint8_t* block = codec::block_of(kGeometry, panel, row / 32);
    const int64_t e = row % 32;
    return codec::from_f16(codec::load_u16(block + 2 * c)) *
           static_cast<float>(block[kQuants + (e / 4) * 64 + 4 * c + e % 4] - 128);
  }
};

// Q4_0 and Q4_1: w = d * (q - 8), or d * q + m.
template <Format kFormat>
struct Q4Blocks : GgufBlockFormat<kFormat == Format::kQ4_1 ? 20 : 18, kFormat == Format::kQ4_1 ? 4 : 2,
                             kFormat == Format::kQ4_1 ? 64 : 32> {
  using Base = GgufBlockFormat<kFormat == Format::kQ4_1 ? 20 : 18, kFormat == Format::kQ4_1 ? 4 : 2,
                          kFormat == Format::kQ4_1 ? 64 : 32>;
  static constexpr Geometry kGeometry{32, Base::kQuants + 4 * 64, 0};
  // Value e (0..31) of a GGUF Q4 block's 16 quant bytes: low nibbles hold 0..15, high nibbles 16..31.
  static uint32_t q4_value(const uint8_t* quants, int e) { return e < 16 ? quants[e] & 0xf : quants[e - 16] >> 4; }
  static void pack(const GgufRows& source, int64_t, int64_t column, int64_t b, uint8_t* panel, int c) {
    uint8_t* block = codec::block_of(kGeometry, panel, b);
    const uint8_t* values = Base::scales_packed(source, column, b, block, c);
    for (int g = 0; g < 4; ++g) {
      for (int j = 0; j < 4; ++j) {
        const uint32_t pair = q4_value(values, 8 * g + j) | q4_value(values, 8 * g + 4 + j) << 4;
        block[Base::kQuants + g * 64 + 4 * c + j] = static_cast<uint8_t>(pair);
      }
    }
  }
  static float value(const uint8_t* panel, int c, int64_t row) {
    const uint8_t* block = codec::block_of(kGeometry, panel, row / 32);
    const int64_t e = row % 32;
    const float d = codec::from_f16(codec::load_u16(block + 2 * c));
    const uint8_t pair = block[Base::kQuants + (e / 8) * 64 + 4 * c + e % 4];
    const float q = static_cast<float>(e % 8 < 4 ? pair & 0xf : pair >> 4);
    if constexpr (kFormat == Format::kQ4_0) return d * (q - 8.0f);
    return d * q + codec::from_f16(codec::load_u16(block + 32 + 2 * c));
  }
};

template <>
struct FormatTraits<Format::kQ4_0> : Q4Blocks<Format::kQ4_0> {};
template <>
struct FormatTraits<Format::kQ4_1> : Q4Blocks<Format::kQ4_1> {};

template <Format kFormat>
using FormatTag = std::integral_constant<Format, kFormat>;

template <class F, Format... kFormats>
inline __attribute__((always_inline)) void visit_format_of(FormatList<kFormats...>, Format format, F&& f) {
  ((format == kFormats ? f(FormatTag<kFormats>{}) : void()), ...);
}

// f(FormatTag<format>{}) for a format of the table; nothing for an id of none. Always inlined, so that code of
// an instruction-set region may call it (its calls then belong to the region's code).
template <class F>
inline __attribute__((always_inline)) void visit_format(Format format, F&& f) {
  visit_format_of(Formats{}, format, f);
}

inline bool is_format(int id) {
  bool found = false;
  visit_format(static_cast<Format>(id), [&](auto) { found = true; });
  return found;
}

// Whether `format` is packed from a Source (DenseWeights, Int8Weights, GgufRows).
template <class Source>
inline bool packs_from(Format format) {
  bool packs = false;
  visit_format(format, [&](auto tag) { packs = std::is_same_v<typename FormatTraits<tag.value>::Source, Source>; });
  return packs;
}

inline Geometry geometry(Format format) {
  Geometry g{1, 64, 0};
  visit_format(format, [&](auto tag) { g = FormatTraits<tag.value>::kGeometry; });
  return g;
}

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
