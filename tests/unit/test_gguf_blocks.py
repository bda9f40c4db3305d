"""Which GGUF matrices the custom GEMM serves as blocks, and Q4_K regrouped into Q4_1 blocks: the file's 4-bit
values under scales rounded once to fp16 (gguf's own dequantization is the reference)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from worker.layers.weight_format import Q4_K_BLOCK_BYTES, WeightFormat, served_blocks


def q4_k_rows(rng, out_features: int, in_features: int) -> np.ndarray:
    """Random Q4_K rows: any bytes are valid blocks once d and dmin are ordinary fp16 numbers."""
    blocks = rng.integers(0, 256, size=(out_features * in_features // 256, Q4_K_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 2e-2, len(blocks)).astype(np.float16)[:, None].view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-4, 2e-2, len(blocks)).astype(np.float16)[:, None].view(np.uint8)
    return blocks.reshape(out_features, -1)


@pytest.mark.parametrize("out_features, in_features", [(3, 256), (5, 768)])
def test_q4_k_is_served_as_q4_1_blocks_of_the_same_values_up_to_fp16_scales(out_features, in_features):
    rows = q4_k_rows(np.random.default_rng(in_features), out_features, in_features)
    expected = dequantize(rows, GGMLQuantizationType.Q4_K).reshape(out_features, in_features)

    blocks = served_blocks(GGMLQuantizationType.Q4_K, rows, in_features)

    assert blocks is not None and blocks.format == WeightFormat.Q4_1
    assert blocks.rows.nbytes == rows.nbytes * 160 // 144
    got = blocks.dequantized()
    # Each weight is d*sc*q - dmin*m with q <= 15: each of the two scales is off by at most 2^-11 of itself.
    d, dmin = (
        rows.reshape(-1, Q4_K_BLOCK_BYTES)[:, i : i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2)
    )
    bound = (2.0**-11 * (15 * 63 * d + 63 * dmin)).repeat(256).reshape(out_features, in_features)
    assert np.all(np.abs(got - expected) <= bound)
    # Not a coincidence of scales: the values themselves spread over the 16 levels of each group.
    assert len(np.unique(got[0, :32])) > 4


def test_blocks_the_gemm_reads_as_stored_and_types_it_does_not():
    weight = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    for gguf_type, weight_format in [
        (GGMLQuantizationType.Q4_0, WeightFormat.Q4_0),
        (GGMLQuantizationType.Q4_1, WeightFormat.Q4_1),
        (GGMLQuantizationType.Q8_0, WeightFormat.Q8_0),
    ]:
        rows = quantize(weight, gguf_type)
        blocks = served_blocks(gguf_type, rows, 64)
        assert blocks.format == weight_format and blocks.rows is rows
    assert served_blocks(GGMLQuantizationType.Q6_K, np.zeros((4, 210), np.uint8), 256) is None
    assert served_blocks(GGMLQuantizationType.F16, np.zeros((4, 128), np.uint8), 64) is None


def test_a_q4_k_scale_past_fp16_range_is_served_as_values_instead():
    rows = q4_k_rows(np.random.default_rng(2), 2, 256)
    rows[0, 0:2] = np.array([60000.0], np.float16).view(np.uint8)  # d * sc > 65504 for sc >= 2
    rows[0, 4:16] = 0xFF
    assert served_blocks(GGMLQuantizationType.Q4_K, rows, 256) is None
