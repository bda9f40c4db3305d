#include "weight_pack.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace bs::linear {
namespace {

template <class Source>
void pack_panels(Format format, const Source& source, int64_t k, int64_t n, uint8_t* packed) {
  visit_format(format, [&](auto tag) {
    using Row = FormatTraits<tag.value>;
    if constexpr (std::is_same_v<typename Row::Source, Source>) {
      const int64_t panels = num_panels(n), bytes = panel_bytes(tag.value, k), blocks = num_blocks(tag.value, k);
#pragma omp parallel for schedule(static)
      for (int64_t p = 0; p < panels; ++p) {
        uint8_t* panel = packed + p * bytes;
        std::memset(panel, 0, bytes);  // columns past n: zero scales, zero weights
        const int64_t cols = std::min<int64_t>(kPanelWidth, n - p * kPanelWidth);
        for (int64_t b = 0; b < blocks; ++b) {
          for (int c = 0; c < cols; ++c) Row::pack(source, k, p * kPanelWidth + c, b, panel, c);
        }
      }
    }
  });
}

// out[0..k) = column `column` of W, dequantized.
template <Format kFormat>
void unpack_column(const uint8_t* packed, int64_t k, int64_t column, float* out) {
  const uint8_t* panel = packed + (column / kPanelWidth) * panel_bytes(kFormat, k);
  const int c = static_cast<int>(column % kPanelWidth);
  for (int64_t row = 0; row < k; ++row) out[row] = FormatTraits<kFormat>::value(panel, c, row);
}

}  // namespace

void pack(Format format, const DenseWeights& source, int64_t k, int64_t n, uint8_t* packed) {
  pack_panels(format, source, k, n, packed);
}

void pack(Format format, const Int8Weights& source, int64_t k, int64_t n, uint8_t* packed) {
  pack_panels(format, source, k, n, packed);
}

void pack(Format format, const GgufRows& source, int64_t k, int64_t n, uint8_t* packed) {
  pack_panels(format, source, k, n, packed);
}

int64_t gguf_row_bytes(Format format, int64_t k) {
  int64_t bytes = 0;
  visit_format(format, [&](auto tag) {
    using Row = FormatTraits<tag.value>;
    if constexpr (std::is_same_v<typename Row::Source, GgufRows>) bytes = Row::row_bytes(k);
  });
  return bytes;
}

void unpack_columns(Format format, const uint8_t* packed, int64_t k, const int64_t* columns, int64_t count,
                    float* out) {
  visit_format(format, [&](auto tag) {
#pragma omp parallel for schedule(static) if (count > 16)
    for (int64_t i = 0; i < count; ++i) unpack_column<tag.value>(packed, k, columns[i], out + i * k);
  });
}

}  // namespace bs::linear
