// The KV cache's element types: what a cache holds per value. Each has a row of conversions (KvElement<T>,
// kv_element.h) and a Paddle dtype (paged_attention.cc); the kernel sets, the caches and the attention are
// templates over this list. Plain C++: also included by code that does not include Paddle's headers.
#pragma once

#include <cstdint>

namespace bs {

// bf16: the upper half of an fp32, rounded to nearest even.
struct Bf16 {
  uint16_t bits;
};

// The 8-bit caches: a row (one token's kv head, head_dim values) is head_dim 8-bit codes, then the row's scale as a
// bf16 in the row's last 2 elements (value = decoded code * scale). The scale is the row's largest magnitude over
// the code's largest, rounded up to a bf16, so that no code overflows; a zero row has scale 0.
// int8: codes -127..127, rounded to nearest even.
struct Int8 {
  int8_t bits;
};
// fp8 e4m3 (OCP's "fn": no infinities, 0x7f/0xff NaN): 1 sign, 4 exponent (bias 7), 3 mantissa bits; codes up to
// +-448, rounded to nearest even.
struct Fp8E4M3 {
  uint8_t bits;
};

// How a row of head_dim values lies in a cache of T: kScaleElements elements after the values hold its scale.
template <class T>
struct KvRowLayout {
  static constexpr int64_t kScaleElements = 0;
};
template <>
struct KvRowLayout<Int8> {
  static constexpr int64_t kScaleElements = 2;
};
template <>
struct KvRowLayout<Fp8E4M3> {
  static constexpr int64_t kScaleElements = 2;
};
// The most head_dim a scaled cache's row may have (a key's row is rotated in fp32 on the stack, then written).
constexpr int64_t kMaxScaledHeadDim = 1024;

// Elements from one row's start to the next's.
template <class T>
constexpr int64_t kv_row_elements(int64_t head_dim) {
  return head_dim + KvRowLayout<T>::kScaleElements;
}

// An int8 cache in groups: the layout the kernel sets with AVX512-VNNI keep (KernelSet::write_int8_groups) where it
// fits (int8_groups_fit: blocks of a multiple of 16 slots, head_dim a multiple of 16), so that vpdpbusd scores 16
// keys and sums 4 keys' values at once as stored (attention_int8_groups.h). The bytes a block holds are the same as
// its rows' (the tensor's shape does not change), ordered per group of 16 consecutive slots and kv head: group
// (slot / 16) * num_kv_heads + kv_head, 16 * (head_dim + 2) bytes each, in it slot `lane` = slot % 16:
//   a key's codes:   byte (d / 4) * 64 + lane * 4 + d % 4 holds dim d (a vector of 64 bytes: 16 keys' dims 4m..4m+3)
//   a value's codes: byte (lane / 4) * 4 * head_dim + d * 4 + lane % 4 holds dim d (4 keys' codes of a dim together)
//   the scales:      at 16 * head_dim + 2 * lane, as bf16 (each the row's scale, as a row stores it)
// The codes and scales are the rows' (KvElement<Int8>::store_scaled_row), bit for bit, only placed apart.
// worker/attention/kv_rows.py (rows_in_groups) is the layout's NumPy reference.
struct Int8Groups {
  static constexpr int64_t kSlots = 16;
  static constexpr int64_t bytes(int64_t head_dim) { return kSlots * (head_dim + 2); }
  static constexpr int64_t index(int64_t slot, int64_t kv_head, int64_t num_kv_heads) {
    return (slot / kSlots) * num_kv_heads + kv_head;
  }
  static constexpr int64_t key_code(int64_t lane, int64_t d) { return (d / 4) * 64 + lane * 4 + d % 4; }
  static constexpr int64_t value_code(int64_t lane, int64_t d, int64_t head_dim) {
    return (lane / 4) * 4 * head_dim + d * 4 + lane % 4;
  }
  static constexpr int64_t scale(int64_t lane, int64_t head_dim) { return kSlots * head_dim + 2 * lane; }
};
constexpr bool int8_groups_fit(int64_t block_size, int64_t head_dim) {
  return block_size % Int8Groups::kSlots == 0 && head_dim % 16 == 0;
}

template <class... Ts>
struct TypeList {};

// Every KV element type.
using KvElementTypes = TypeList<float, Bf16, Int8, Fp8E4M3>;

template <class T>
struct TypeTag {
  using type = T;
};

// f(TypeTag<T>{}) for every T of the list.
template <class... Ts, class F>
inline void for_each_type(TypeList<Ts...>, F&& f) {
  (f(TypeTag<Ts>{}), ...);
}

}  // namespace bs
