// Packing weights into the panel formats of weight_format.h, and reading columns back (the rows of a tied
// embedding): one loop over panels, blocks and columns for every format, each format's row (FormatTraits)
// packing and reading its own blocks. Baseline x86-64 code: it runs once at load, or per looked-up token.
#pragma once

#include <cstdint>

#include "weight_format.h"

namespace bs::linear {

// W[k, n] packed in `format` from `source`, which must be the format's Source (packs_from<Source>(format)):
// F32 or BF16 from fp32 weights (bf16 rounded to nearest even), INT8 from int8 with a scale per column, the Q
// formats from GGUF rows of whole blocks (k a multiple of 32).
void pack(Format format, const DenseWeights& source, int64_t k, int64_t n, uint8_t* packed);
void pack(Format format, const Int8Weights& source, int64_t k, int64_t n, uint8_t* packed);
void pack(Format format, const GgufRows& source, int64_t k, int64_t n, uint8_t* packed);

// Bytes of one GGUF row of k values in `format`'s blocks (k a multiple of 32; 0 for a format not from GgufRows).
int64_t gguf_row_bytes(Format format, int64_t k);

// out[i * k .. (i + 1) * k) = column columns[i] of W, dequantized, for i < count (an embedding's rows); the
// columns must be in [0, n).
void unpack_columns(Format format, const uint8_t* packed, int64_t k, const int64_t* columns, int64_t count,
                    float* out);

}  // namespace bs::linear
