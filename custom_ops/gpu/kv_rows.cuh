// The KV cache's rows on the GPU. A row is one token's kv head. A cache of the activations' type T (float, bf16,
// fp16) holds head_dim values a row; an 8-bit cache holds head_dim codes and then the row's scale, a bf16 in 2 more
// bytes (value = the code's value * scale). The scale is the row's largest magnitude over the largest code (127 for
// int8, 448 for fp8 e4m3), rounded up to a bf16 so that no code overflows; a zero row has scale 0. This is
// worker/attention/kv_rows.py's format (encode_rows), which the CPU kernels write too (custom_ops/cpu/kv_types.h),
// bit for bit: every float operation of an encode here is a correctly rounded __f*_rn, never contracted.
#pragma once

#include "numeric.cuh"

namespace bs::gpu {

// int8 codes -127..127, rounded to nearest even.
struct Int8Code {
  uint8_t bits;
};
// fp8 e4m3 codes (OCP's "fn": 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f/0xff are NaN and never
// written), up to +-448, rounded to nearest even.
struct Fp8E4M3Code {
  uint8_t bits;
};

// How a cache of element type C holds a row: a cache of T (kScaled false) its values as they are.
template <class C>
struct KvRow {
  static constexpr bool kScaled = false;
  static constexpr int kScaleElements = 0;
};

// The 8-bit rows' common part: the scale in the 2 bytes after the codes, little-endian as the CPU writes it.
struct ScaledKvRow {
  static constexpr bool kScaled = true;
  static constexpr int kScaleElements = 2;

  BS_DEVICE static float scale(const uint8_t* row, int dim) {
    return __uint_as_float((static_cast<unsigned>(row[dim]) | static_cast<unsigned>(row[dim + 1]) << 8) << 16);
  }
  // The bits of the least bf16 >= largest / top (largest finite and >= 0).
  BS_DEVICE static unsigned scale_bits(float largest, float top) {
    return (__float_as_uint(__fdiv_rn(largest, top)) + 0xffffu) >> 16;
  }
  BS_DEVICE static void write_scale(uint8_t* row, int dim, unsigned bits) {
    row[dim] = static_cast<uint8_t>(bits & 0xffu);
    row[dim + 1] = static_cast<uint8_t>(bits >> 8);
  }
  // What takes a value to 1/scale times it (0 for a zero row), times `unit`.
  BS_DEVICE static float to_code(unsigned bits, float unit) {
    const float scale = __uint_as_float(bits << 16);
    return scale > 0.0f ? __fmul_rn(__fdiv_rn(1.0f, scale), unit) : 0.0f;
  }
};

template <>
struct KvRow<Int8Code> : ScaledKvRow {
  static constexpr float kTopCode = 127.0f;
  static constexpr float kCodeUnit = 1.0f;  // code(value * to_code) takes value / scale itself

  BS_DEVICE static float value(unsigned code) { return static_cast<float>(static_cast<int8_t>(code)); }
  BS_DEVICE static uint8_t code(float scaled) {
    return static_cast<uint8_t>(__float2int_rn(fminf(127.0f, fmaxf(-127.0f, scaled))) & 0xff);
  }
};

// A code's 7 magnitude bits placed at bits 20..26 of an fp32 make 2^-120 times its value (normal and subnormal
// codes alike), its sign at bit 31: code() takes 2^-120 times a value (within +-448) and rounds bits 20..26. Small
// codes are fp32 subnormals there: built without flushing them to zero (cuda_build.py's -ftz=false).
template <>
struct KvRow<Fp8E4M3Code> : ScaledKvRow {
  static constexpr float kTopCode = 448.0f;
  static constexpr float kCodeUnit = 0x1p-120f;

  BS_DEVICE static float value(unsigned code) {
    return __uint_as_float((code & 0x80u) << 24 | (code & 0x7fu) << 20) * 0x1p120f;  // exact
  }
  BS_DEVICE static uint8_t code(float scaled) {
    const unsigned bits = __float_as_uint(scaled), magnitude = bits & 0x7fffffffu;
    const unsigned rounded = (magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20;
    return static_cast<uint8_t>((rounded > 0x7eu ? 0x7eu : rounded) | ((bits >> 24) & 0x80u));
  }
};

// Elements from one row's start to the next's.
template <class C>
BS_HOST_DEVICE constexpr int64_t kv_row_elements(int64_t head_dim) {
  return head_dim + KvRow<C>::kScaleElements;
}

// The attention's unit of loading: 8 codes. A row starts 2-byte aligned (head_dim + 2 bytes apart, head_dim a
// multiple of 8), so the codes come as 4 pairs.
template <>
struct Chunk<Int8Code> {
  static constexpr int kElements = 8;
};
template <>
struct Chunk<Fp8E4M3Code> {
  static constexpr int kElements = 8;
};

template <class C>
BS_DEVICE void load_codes(const C* source, float* out) {
  const uint16_t* pairs = reinterpret_cast<const uint16_t*>(source);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned pair = pairs[i];
    out[2 * i] = KvRow<C>::value(pair & 0xffu);
    out[2 * i + 1] = KvRow<C>::value(pair >> 8);
  }
}
BS_DEVICE void load_chunk(const Int8Code* source, float* out) { load_codes(source, out); }
BS_DEVICE void load_chunk(const Fp8E4M3Code* source, float* out) { load_codes(source, out); }

// The scale of a cache row (1 for a cache of T: never read).
template <class C>
BS_DEVICE float row_scale(const C* row, int dim) {
  if constexpr (KvRow<C>::kScaled) {
    return KvRow<C>::scale(reinterpret_cast<const uint8_t*>(row), dim);
  } else {
    return 1.0f;
  }
}

// Writes value(i), i < dim, as an 8-bit row of C at `row`: one warp a row, its lanes every 32nd element; value(i)
// must give the same float each time it is asked. Reached by the whole block (the warp's reduction); `active`
// false: the warp has no row this time.
template <class C, class Value>
BS_DEVICE void store_scaled_row(C* row, int dim, bool active, Value value) {
  using Row = KvRow<C>;
  const int lane = lane_id();
  float largest = 0.0f;
  if (active) {
    for (int i = lane; i < dim; i += kWarpSize) largest = fmaxf(largest, fabsf(value(i)));
  }
  largest = warp_max(largest);
  if (!active) return;
  uint8_t* bytes = reinterpret_cast<uint8_t*>(row);
  const unsigned bits = Row::scale_bits(largest, Row::kTopCode);
  if (lane == 0) Row::write_scale(bytes, dim, bits);
  const float to_code = Row::to_code(bits, Row::kCodeUnit);
  for (int i = lane; i < dim; i += kWarpSize) bytes[i] = Row::code(__fmul_rn(value(i), to_code));
}

// Returns body(T{}, Cache{}): T the activations' element type, Cache the cache's (T itself or an 8-bit code).
template <class Body>
Status dispatch_kv_dtypes(Dtype activations, Dtype cache, Body body) {
  return dispatch_dtype(activations, [&](auto tag) -> Status {
    switch (cache) {
      case Dtype::kInt8:
        return body(tag, Int8Code{});
      case Dtype::kFp8E4M3:
        return body(tag, Fp8E4M3Code{});
      default:
        return cache == activations ? body(tag, tag) : kInvalidArgument;
    }
  });
}

}  // namespace bs::gpu
