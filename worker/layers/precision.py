"""What the worker keeps weights and the KV cache in: BLOCKSERVE_DTYPE and BLOCKSERVE_QUANTIZATION resolved
for the chosen kernels (and their CPU), and the weight format each tensor gets on the custom CPU path."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from worker.attention.kv_rows import EIGHT_BIT
from worker.layers.weight_format import GgufBlocks, WeightFormat

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "gguf")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8")  # fp8: vLLM's name of e4m3


class PrecisionUnavailable(ValueError):
    """The settings ask for a dtype or quantization the chosen kernels cannot serve."""


@dataclass(frozen=True)
class Precision:
    dtype: str  # float32 | bfloat16 | float16 (GPU): the KV cache and every weight not quantized (sums are fp32)
    quantization: str  # none | int8 | gguf
    reason: str  # why this dtype, for the start-up log
    kv_cache: str = ""  # BLOCKSERVE_KV_CACHE_DTYPE resolved, "" = dtype

    @property
    def kv_cache_dtype(self) -> str:
        """What the KV cache holds: float32, bfloat16, float16, int8 or fp8_e4m3 (attention/kv_rows.py)."""
        return self.kv_cache or self.dtype

    def weight_format(self, weight: np.ndarray | GgufBlocks) -> WeightFormat:
        """The packed format of one weight matrix on the custom path."""
        if self.quantization == "gguf" and isinstance(weight, GgufBlocks):
            return weight.format
        if self.quantization == "int8":
            return WeightFormat.INT8
        return WeightFormat.BF16 if self.dtype == "bfloat16" else WeightFormat.F32


def resolve_precision(
    dtype: str,
    quantization: str,
    kernels: str,
    bf16_dot: bool = False,
    attention_problem: str | None = None,
    gguf_file: bool = False,
    measured_dtype: tuple[str, str] | None = None,
) -> Precision:
    """The precision for the settings on `kernels` (the chosen kernels' name); `bf16_dot`: the custom CPU ops
    may multiply bf16 with AVX512-BF16; `attention_problem`: why the kernels' attention cannot take the model's
    heads (Kernels.attention_problem), so that the pure-Paddle attention serves them.

    - custom (the C++ CPU ops): float32 or bfloat16, any quantization. `auto` is `measured_dtype` (dtype, reason)
      where given: the faster of the two on this CPU (layers/dtype_probe.py); else bfloat16 (with AVX512-BF16
      the ops multiply it natively; on AVX2 they widen it to float32 in registers). Quantization `auto` serves
      a GGUF file (`gguf_file`) as stored, as llama.cpp does: `gguf`; any other checkpoint keeps its precision
      class: `none`.
    - cuda (the CUDA ops on a GPU): float32, bfloat16 or float16, weights unquantized in that dtype (the
      linear layers are Paddle's matmul); `auto` is bfloat16; quantization `auto` is `none`.
    - paddle: float32 only; so too the custom and CUDA kernels where the pure-Paddle attention serves the model's
      heads: it computes and caches in float32 (`auto` is float32 then).

    An explicit setting the kernels cannot serve raises PrecisionUnavailable rather than silently serving
    something else.
    """
    if dtype not in DTYPES or quantization not in QUANTIZATIONS:
        raise ValueError(f"dtype {dtype!r} / quantization {quantization!r} not in {DTYPES} / {QUANTIZATIONS}")
    precision = _resolve(
        dtype,
        resolve_quantization(quantization, kernels, gguf_file),
        kernels,
        bf16_dot,
        attention_problem,
        measured_dtype,
    )
    if quantization == "auto" and precision.quantization == "gguf":
        return Precision(
            precision.dtype, "gguf", f"{precision.reason}; quantization auto: the GGUF file's blocks as stored"
        )
    return precision


def resolve_quantization(quantization: str, kernels: str, gguf_file: bool) -> str:
    """BLOCKSERVE_QUANTIZATION resolved: `auto` serves a GGUF file's own blocks where the kernels can (custom)."""
    if quantization != "auto":
        return quantization
    return "gguf" if gguf_file and kernels == "custom" else "none"


def _resolve(
    dtype: str,
    quantization: str,
    kernels: str,
    bf16_dot: bool,
    attention_problem: str | None,
    measured_dtype: tuple[str, str] | None,
) -> Precision:
    if attention_problem is not None and kernels != "paddle":
        return _for_paddle_attention(dtype, quantization, kernels, attention_problem)
    if kernels == "cuda":
        _check_gpu_quantization(quantization)
        if dtype == "auto":
            return Precision("bfloat16", "none", "auto: bfloat16 on a GPU with the CUDA kernels")
        return Precision(dtype, "none", f"BLOCKSERVE_DTYPE={dtype}")
    if dtype == "float16":
        raise PrecisionUnavailable(
            f"BLOCKSERVE_DTYPE=float16 is served on a GPU with the CUDA kernels only; the {kernels} kernels "
            "take float32" + (" or bfloat16" if kernels == "custom" else "")
        )
    if kernels != "custom":
        if dtype == "bfloat16" or quantization != "none":
            raise PrecisionUnavailable(
                f"BLOCKSERVE_DTYPE={dtype} BLOCKSERVE_QUANTIZATION={quantization} needs the custom kernels; "
                "the pure-Paddle kernels compute in float32"
            )
        return Precision("float32", "none", "pure-Paddle kernels compute in float32")
    if dtype != "auto":
        return Precision(dtype, quantization, f"BLOCKSERVE_DTYPE={dtype}")
    if measured_dtype is not None:
        return Precision(measured_dtype[0], quantization, measured_dtype[1])
    if bf16_dot:
        return Precision("bfloat16", quantization, "auto: the CPU multiplies bf16 natively (AVX512-BF16)")
    return Precision("bfloat16", quantization, "auto: bf16 storage, widened to float32 in registers (no AVX512-BF16)")


def _for_paddle_attention(dtype: str, quantization: str, kernels: str, attention_problem: str) -> Precision:
    """float32 for kernels whose own attention cannot take the model's heads: the pure-Paddle attention that serves
    them computes and caches in float32 (in bfloat16 its cache and its float32 queries would not meet)."""
    if kernels == "cuda":
        _check_gpu_quantization(quantization)
    if dtype not in ("auto", "float32"):
        raise PrecisionUnavailable(
            f"BLOCKSERVE_DTYPE={dtype}: this model's attention runs in pure Paddle ({attention_problem} for the "
            f"{kernels} kernels), which computes in float32: BLOCKSERVE_DTYPE=float32 or auto serves it"
        )
    setting = "auto" if dtype == "auto" else "BLOCKSERVE_DTYPE=float32"
    return Precision(
        "float32", quantization, f"{setting}: the pure-Paddle attention ({attention_problem}) computes in float32"
    )


def _check_gpu_quantization(quantization: str) -> None:
    if quantization != "none":
        raise PrecisionUnavailable(
            f"BLOCKSERVE_QUANTIZATION={quantization} is served by the custom CPU kernels only; on a GPU the "
            "weights are kept in BLOCKSERVE_DTYPE (set BLOCKSERVE_QUANTIZATION=none, or BLOCKSERVE_DEVICE=cpu)"
        )


def resolve_kv_cache(
    setting: str, precision: Precision, kernels: str, attention_problem: str | None = None
) -> Precision:
    """`precision` with BLOCKSERVE_KV_CACHE_DTYPE resolved: `auto` is the precision's dtype (as vLLM's auto is the
    model's); another type than the dtype needs the custom kernels' attention: the C++ CPU kernels', whose every ISA
    path reads float32, bfloat16, int8 and fp8_e4m3 caches, or the CUDA kernels', which read a cache of the dtype or
    an 8-bit one (int8, fp8_e4m3). The pure-Paddle attention computes and caches in float32."""
    if setting not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {setting!r} not in {KV_CACHE_DTYPES}")
    kv_cache = "fp8_e4m3" if setting == "fp8" else setting
    if kv_cache in ("auto", precision.dtype):
        return precision
    if kernels not in ("custom", "cuda") or attention_problem is not None:
        served_by = (
            f"the {kernels} kernels"
            if attention_problem is None
            else f"the pure-Paddle attention ({attention_problem})"
        )
        raise PrecisionUnavailable(
            f"BLOCKSERVE_KV_CACHE_DTYPE={setting} is served by the custom kernels' attention only (C++ on a CPU, CUDA "
            f"on a GPU); {served_by} cache in BLOCKSERVE_DTYPE ({precision.dtype}): set BLOCKSERVE_KV_CACHE_DTYPE=auto"
        )
    if kernels == "cuda" and kv_cache not in EIGHT_BIT:
        raise PrecisionUnavailable(
            f"BLOCKSERVE_KV_CACHE_DTYPE={setting}: the CUDA kernels cache in BLOCKSERVE_DTYPE ({precision.dtype}) or "
            "in 8-bit rows (int8, fp8_e4m3)"
        )
    if kernels == "custom" and kv_cache == "float16":
        raise PrecisionUnavailable(
            "BLOCKSERVE_KV_CACHE_DTYPE=float16 is served on a GPU only; the custom CPU kernels cache float32, "
            "bfloat16, int8 or fp8_e4m3"
        )
    return replace(precision, kv_cache=kv_cache, reason=f"{precision.reason}; KV cache {kv_cache}")
