// The packed-weight GEMM: y = x @ W (+ bias) for every weight format of weight_format.h.
#pragma once

#include <cstdint>

#include "isa.h"
#include "weight_format.h"

namespace bs::linear {

// y[m, n] = x[m, k] @ W + bias (bias may be null) with W packed in `format` (weight_pack.h), on the
// fastest kernel `isa` has for m rows: AMX tiles where the rows are many enough (tdpbf16ps, tdpbsud: the same
// operands as below; from more rows, tdpbf16ps on INT8 and GGUF panels dequantized to bf16, x rounded to bf16),
// vdpbf16ps for BF16 (x rounded to bf16), vpdpbusd for INT8 and the GGUF blocks (x quantized per 32 inputs to
// int8), else the weights widened to fp32 (x as it is); BF16 from isa.onednn_rows rows on oneDNN's matmul
// (linear_onednn.h), where the worker measured it faster.
void gemm(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n,
          const float* bias, float* y);

// out[m, n / 2] = silu(gate) * up of y = x @ W for a gate|up weight (gate: y's first n / 2 columns), computed from
// the GEMM's registers without writing y, where the kernel has that: BF16 on AVX512-BF16 from 16 rows (where the
// product is too large for the cache), BF16 and the int8 formats on AMX; no bias, n / 2 a multiple of 16. Otherwise
// false, and nothing is written.
bool gemm_silu_and_mul(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed,
                       int64_t n, const float* bias, float* out);

}  // namespace bs::linear
