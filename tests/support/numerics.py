"""NumPy references for the worker's number formats, and the model geometry the kernel tests share."""

from __future__ import annotations

import numpy as np

from worker.models.config import ModelConfig, RopeConfig


def bf16_rounded(array: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (ties to even), as fp32."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def int8_query_rows(rows: np.ndarray) -> np.ndarray:
    """Scaled query rows [..., head_dim] as the attention multiplies them with an int8 cache's codes by vpdpbusd
    (attention_int8_dot.h): each row's codes rint(x * (127 / its largest magnitude)) times that largest / 127."""
    rows = np.asarray(rows, dtype=np.float32)
    largest = np.abs(rows).max(axis=-1, keepdims=True)
    to_code = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, np.float32(1)), np.float32(0))
    codes = np.clip(np.rint(rows * to_code.astype(np.float32)), -127, 127)
    return (codes * (largest / np.float32(127))).astype(np.float32)


def attention_config(num_heads: int, num_kv_heads: int, head_dim: int, max_positions: int) -> ModelConfig:
    """A one-layer model's config with just the attention geometry set (what the attention kernels read)."""
    return ModelConfig(
        architecture="llama",
        vocab_size=1,
        hidden_size=num_heads * head_dim,
        intermediate_size=1,
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope=RopeConfig(theta=10000.0),
    )
