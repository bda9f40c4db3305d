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

template <class... Ts>
struct TypeList {};

// Every KV element type.
using KvElementTypes = TypeList<float, Bf16>;

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
