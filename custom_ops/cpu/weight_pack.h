// Packing weights into the panel formats of weight_format.h, and reading single columns back
// (the rows of a tied embedding). Baseline x86-64 code: it runs once at load, or per looked-up token.
#pragma once

#include <cstdint>

#include "weight_format.h"

namespace bs::linear {

// w[k, n] fp32 (row-major) -> packed F32 or BF16 panels (bf16 rounded to nearest even).
void pack_float(Format format, const float* w, int64_t k, int64_t n, uint8_t* packed);

// q[k, n] int8 with one scale per column -> packed INT8 panels.
void pack_int8(const int8_t* q, const float* scales, int64_t k, int64_t n, uint8_t* packed);

// GGUF blocks as stored: n rows (output features) of k / 32 blocks each -> packed Q panels.
void pack_gguf(Format format, const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, uint8_t* packed);

// Bytes of one GGUF row of k values in `format`'s blocks (k a multiple of 32).
int64_t gguf_row_bytes(Format format, int64_t k);

// out[0..k) = column `column` of W, dequantized.
void unpack_column(Format format, const uint8_t* packed, int64_t k, int64_t column, float* out);

// out[i * k .. (i + 1) * k) = column columns[i] of W, dequantized, for i < count (an embedding's rows); the
// columns must be in [0, n).
void unpack_columns(Format format, const uint8_t* packed, int64_t k, const int64_t* columns, int64_t count,
                    float* out);

}  // namespace bs::linear
