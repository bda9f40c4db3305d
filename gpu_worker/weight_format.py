"""The weight formats of the custom linear op (custom_ops/cpu/weight_format.h), a GGUF tensor's blocks as
stored, and int8 quantization with one scale per output feature."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize


class WeightFormat(IntEnum):
    """Ids as custom_ops/cpu/weight_format.h has them: GGML's type ids where GGML has the format."""

    F32 = 0
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    BF16 = 30
    INT8 = 256  # int8 with one fp32 scale per output feature

    @property
    def is_gguf_block(self) -> bool:
        return self in (WeightFormat.Q4_0, WeightFormat.Q4_1, WeightFormat.Q8_0)


# GGUF tensor types the custom GEMM serves as stored (dequantized inside its micro-kernel).
SERVED_GGUF_TYPES = {
    GGMLQuantizationType.Q4_0: WeightFormat.Q4_0,
    GGMLQuantizationType.Q4_1: WeightFormat.Q4_1,
    GGMLQuantizationType.Q8_0: WeightFormat.Q8_0,
}


@dataclass(frozen=True)
class GgufBlocks:
    """A GGUF matrix as its file stores it: one row of quantized blocks per output feature."""

    format: WeightFormat
    rows: np.ndarray  # uint8 [out_features, bytes of one row]
    in_features: int

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]

    def dequantized(self) -> np.ndarray:
        """fp32 [out_features, in_features], the values the blocks stand for."""
        values = dequantize(self.rows, GGMLQuantizationType(int(self.format)))
        return np.asarray(values, dtype=np.float32).reshape(self.out_features, self.in_features)


def dense(weight: np.ndarray | GgufBlocks) -> np.ndarray:
    """The fp32 values of a weight in Hugging Face's [out, in] layout."""
    return weight.dequantized() if isinstance(weight, GgufBlocks) else np.asarray(weight, dtype=np.float32)


def quantize_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, scales) of an [in, out] fp32 weight: q = rint(w / scale) in [-127, 127], scale = max |w| / 127 per
    output column (1 for an all-zero column)."""
    max_abs = np.abs(weight).max(axis=0)
    scales = np.where(max_abs > 0, max_abs / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(weight / scales), -127, 127).astype(np.int8)
    return q, scales
