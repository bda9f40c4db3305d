"""Rotary position embedding: cos/sin tables (default, linear, llama3 and longrope scaling, or no rotation at all)
and their application."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import paddle

from worker.layers.row_gather import take_rows
from worker.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_positions: int) -> np.ndarray:
    """Per-pair rotation speeds, in fp32 like transformers computes them; longrope's factors for contexts of
    `max_positions`."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    if rope.rope_type == "longrope":
        factors = rope.long_factor if max_positions > rope.original_max_positions else rope.short_factor
        stretched = np.asarray(factors, dtype=np.float32) * np.float32(rope.theta) ** exponents
        return (np.float32(1.0) / stretched).astype(np.float32)
    inv_freq = (np.float32(1.0) / np.float32(rope.theta) ** exponents).astype(np.float32)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope.scaling)
    if rope.rope_type == "linear":
        inv_freq = (inv_freq / np.float32(rope.scaling["factor"])).astype(np.float32)
    return inv_freq


def _llama3_scaled(inv_freq: np.ndarray, scaling: dict[str, float]) -> np.ndarray:
    """Llama 3.1's frequency-dependent stretch: slow pairs scaled by `factor`, fast kept, middle blended."""
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context_len / high_freq_factor) & (wavelen <= old_context_len / low_freq_factor)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R with x @ R == concat(-x2, x1) for x = concat(x1, x2): transformers' rotate_half as a matmul."""
    half = head_dim // 2
    matrix = np.zeros((head_dim, head_dim), dtype=np.float32)
    matrix[np.arange(half) + half, np.arange(half)] = -1.0
    matrix[np.arange(half), np.arange(half) + half] = 1.0
    return matrix


@dataclass(frozen=True)
class Rotation:
    """cos/sin of one step's positions, repeated over heads: [tokens, heads, head_dim]."""

    cos: paddle.Tensor
    sin: paddle.Tensor
    rotate_half: paddle.Tensor

    def apply(self, x: paddle.Tensor) -> paddle.Tensor:
        """x * cos + rotate_half(x) * sin on [tokens, heads, head_dim], the Hugging Face layout.

        Written without slicing halves or broadcasting: both are slow paths of Paddle's CPU kernels.
        """
        return x * self.cos + paddle.matmul(x, self.rotate_half) * self.sin


class RotaryEmbedding:
    """cos/sin for every position below `max_positions`; for `rope` None, no rotation (cos 1, sin 0)."""

    def __init__(self, rope: RopeConfig | None, head_dim: int, max_positions: int):
        if rope is None:
            angles = np.zeros((max_positions, head_dim), dtype=np.float32)
            factor = np.float32(1.0)
        else:
            inv_freq = inverse_frequencies(rope, head_dim, max_positions)
            angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
            angles = np.concatenate([angles, angles], axis=-1)
            factor = np.float32(rope.attention_factor)
        self.cos = paddle.to_tensor((np.cos(angles) * factor).astype(np.float32))
        self.sin = paddle.to_tensor((np.sin(angles) * factor).astype(np.float32))
        self.rotate_half = paddle.to_tensor(rotate_half_matrix(head_dim))

    def rotation(self, positions: paddle.Tensor, num_heads: int) -> Rotation:
        def per_head(table: paddle.Tensor) -> paddle.Tensor:
            return paddle.tile(take_rows(table, positions).unsqueeze(1), [1, num_heads, 1])

        return Rotation(per_head(self.cos), per_head(self.sin), self.rotate_half)
