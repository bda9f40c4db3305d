"""The weight formats of the custom linear op (custom_ops/cpu/weight_format.h), a GGUF tensor's blocks as
stored, and int8 quantization with one scale per output feature."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize


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
Q4_K_BLOCK_BYTES, Q4_1_BLOCK_BYTES = 144, 20  # 256 weights in 8 groups of 32; 32 weights


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


def served_blocks(tensor_type: GGMLQuantizationType, rows: np.ndarray, in_features: int) -> GgufBlocks | None:
    """A GGUF matrix's blocks (uint8 rows, one per output feature) in a format the custom GEMM serves, or None.

    Q4_0, Q4_1 and Q8_0 are kept as stored. Q4_K (super-blocks of 256: eight groups of 32, each with a 6-bit
    scale and min under the block's fp16 d and dmin, w = d * sc * q - dmin * m) is regrouped into Q4_1
    blocks of 32 with d * sc and -dmin * m as their fp16 scale and offset: the 4-bit values are the file's,
    each scale is rounded once to fp16 (relative error <= 2^-11), and the bytes grow from 144 to 160 per 256
    weights."""
    served = SERVED_GGUF_TYPES.get(tensor_type)
    if served is not None:
        return GgufBlocks(served, rows, in_features)
    if tensor_type != GGMLQuantizationType.Q4_K:
        return None
    blocks = np.ascontiguousarray(rows).reshape(-1, Q4_K_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    with np.errstate(over="ignore"):  # checked below
        group_scale = (d * scales.astype(np.float32)).astype(np.float16)  # [blocks, 8]
        group_offset = (-dmin * mins.astype(np.float32)).astype(np.float16)
    if not (np.isfinite(group_scale).all() and np.isfinite(group_offset).all()):
        return None  # a scale past fp16's range: serve the values instead
    quants = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    quants = (quants & 0x0F).reshape(-1, 8, 32)  # group j = 2c + h: nibble h of bytes 32c..32c+31
    packed_quants = quants[..., :16] | (quants[..., 16:] << 4)  # Q4_1: byte i holds values i and i + 16
    q4_1 = np.concatenate(
        [group_scale[..., None].view(np.uint8), group_offset[..., None].view(np.uint8), packed_quants], axis=-1
    )
    return GgufBlocks(WeightFormat.Q4_1, q4_1.reshape(rows.shape[0], -1), in_features)


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
