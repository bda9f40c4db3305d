// Compile-time loops for the GEMM bodies (included inside their `#pragma GCC target` regions, once per
// instruction set; no include guard, nothing from the standard library instantiated beyond types).

template <int kIndex>
using Index = std::integral_constant<int, kIndex>;

// f(Index<0>{}), ..., f(Index<N - 1>{}): loop indices that stay compile-time constants.
template <class F, int... kIndices>
static inline __attribute__((always_inline)) void unrolled(F&& f, std::integer_sequence<int, kIndices...>) {
  (f(Index<kIndices>{}), ...);
}
template <int N, class F>
static inline __attribute__((always_inline)) void static_for(F&& f) {
  unrolled(f, std::make_integer_sequence<int, N>{});
}

// f(Index<rows>{}) for a run-time 1 <= rows <= N: a register tile of that many rows.
template <class F, int... kRows>
static inline __attribute__((always_inline)) void with_rows_of(int rows, F&& f, std::integer_sequence<int, kRows...>) {
  ((rows == kRows + 1 ? f(Index<kRows + 1>{}) : void()), ...);
}
template <int N, class F>
static inline __attribute__((always_inline)) void with_rows(int rows, F&& f) {
  with_rows_of(rows, f, std::make_integer_sequence<int, N>{});
}
