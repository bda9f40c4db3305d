"""How a family's files lay out weights that the worker's layers read otherwise: q/k rows of rotary pairs
(2i, 2i+1) rather than (i, i + d/2), and Gemma's norm weights stored as w of (1 + w) * x."""

from __future__ import annotations

import numpy as np

from worker.layers.weight_format import GgufBlocks
from worker.models.config import ModelConfig

QUERY_NAMES = ("self_attn.q_proj.", "attn_q.")
KEY_NAMES = ("self_attn.k_proj.", "attn_k.")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (its rotary pairs are (i, i+1), HF's (i, i+d/2))."""
    half_head_dim = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return rows.swapaxes(2, 1).reshape(weight.shape)


def rows_in_half_rotation(name: str, array: np.ndarray | GgufBlocks, config: ModelConfig) -> np.ndarray | GgufBlocks:
    """A q or k projection's weight or bias whose rows rotate pairs (2i, 2i+1), reordered to rotate (i, i + d/2);
    other tensors as they are. q.k is the same sum either way, so attention is unchanged."""
    if any(part in name for part in QUERY_NAMES):
        num_heads = config.num_heads
    elif any(part in name for part in KEY_NAMES):
        num_heads = config.num_kv_heads
    else:
        return array
    if isinstance(array, GgufBlocks):  # whole rows of blocks move: the blocks run along a row
        return GgufBlocks(array.format, unpermute_rows(array.rows, num_heads), array.in_features)
    return unpermute_rows(array, num_heads)


def is_norm_weight(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight")
