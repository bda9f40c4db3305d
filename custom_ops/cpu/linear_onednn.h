// GEMMs of bf16 weights on oneDNN's matmul (the library inside Paddle's wheel, libdnnl.so.3, built in with
// BS_ONEDNN: custom_ops/build.py) from the rows of x where the worker measured it faster than these kernels
// (isa.onednn_rows; worker/layers/gemm_route.py). oneDNN picks its own kernels for the CPU (brgemm on AMX tiles or on
// AVX512-BF16), kept within the op's isa (no AMX for a call whose isa has none). A BF16 weight's panels
// (weight_format.h: 16 columns, each lane a pair of consecutive rows) are oneDNN's BA16a16b2a layout of W[k, n] when k
// is a multiple of 16: oneDNN reads them where they are, no copy. x is rounded to bf16 as the BF16 kernels round it.
#pragma once

#include <cstdint>

#include "isa.h"
#include "weight_format.h"

namespace bs::linear {

// Whether this build has oneDNN and its library is a 3.x (the API these sources use).
bool onednn_available();

// The library's version, major * 10000 + minor * 100 + patch, or 0 where this build has no oneDNN.
int onednn_version();

// Whether `gemm` would take it to oneDNN: BF16 weights, isa.bf16 and m >= isa.onednn_rows > 0, k a multiple of 16,
// not called inside an OpenMP parallel region (the MoE op's threads keep their own GEMMs), oneDNN available.
bool onednn_routes(const Isa& isa, Format format, int64_t m, int64_t k);

// y[m, n] = x[m, k] @ W + bias (bias may be null) on oneDNN's matmul where onednn_routes and oneDNN's kernel for the
// shape is a brgemm (not a reference loop), and the oneDNN the process runs stays within isa (AMX only if isa.amx);
// false, with nothing written, otherwise.
bool onednn_gemm(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed,
                 int64_t n, const float* bias, float* y);

}  // namespace bs::linear
