"""NumPy references for the worker's number formats, and the model geometry the kernel tests share."""

from __future__ import annotations

import numpy as np

from worker.attention.kv_rows import row_scales
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


def int8_weights_error_bound(
    query,
    keys,
    value_rows,
    inputs,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """Per output [tokens, heads, head_dim], how far an int8 cache's attention may move from the exact attention
    over the decoded rows when it rounds each span's weights (probability times value scale) to 8-bit codes of
    the span's largest weight (attention_int8_dot.h's accumulate_values_int8): a weight by at most 1/510 of that
    largest, itself at most the largest over every key the query sees, times each key's |code|.

    query [tokens, heads, head_dim] as the kernel multiplies it (unscaled); keys [slots, kv_heads, head_dim]
    decoded; value_rows [slots, kv_heads, head_dim + 2] the int8 cache's bytes; inputs: the step's StepInputs;
    window and softcap: the layer's sliding window and soft cap, if any (the keys a query sees, its scores)."""
    tokens, num_heads, _ = query.shape
    group = num_heads // keys.shape[1]
    codes = np.abs(value_rows[..., :-2].view(np.int8).astype(np.float64))
    value_scales = row_scales(value_rows)
    bound = np.zeros(query.shape, dtype=np.float64)
    request_of = np.searchsorted(inputs.query_start, np.arange(tokens), side="right") - 1
    for t in range(tokens):
        position = int(inputs.positions[t])
        seen = np.arange(0 if window is None else max(0, position - window + 1), position + 1)
        slots = inputs.block_table[request_of[t], seen // block_size] * block_size + seen % block_size
        for h in range(num_heads):
            kv = h // group
            scores = keys[slots, kv].astype(np.float64) @ (query[t, h].astype(np.float64) * scale)
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            probs = np.exp(scores - scores.max())
            probs /= probs.sum()
            largest = (probs * value_scales[slots, kv]).max()
            bound[t, h] = largest / 510 * codes[slots, kv].sum(axis=0)
    return bound
