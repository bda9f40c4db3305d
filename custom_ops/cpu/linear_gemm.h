// The packed-weight GEMM: y = x @ W (+ bias) for every weight format of weight_format.h.
#pragma once

#include <cstdint>

#include "isa.h"
#include "weight_format.h"

namespace bs::linear {

// y[m, n] = x[m, k] @ W + bias (bias may be null) with W packed in `format` (weight_pack.h), on the
// fastest kernel `isa` has: vdpbf16ps for BF16 (x rounded to bf16), vpdpbusd for INT8 and the GGUF
// blocks (x quantized per 32 inputs to int8), else the weights widened to fp32 (x as it is).
void gemm(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n,
          const float* bias, float* y);

}  // namespace bs::linear
