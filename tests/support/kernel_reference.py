"""NumPy references of the worker's kernels, in the element types the CUDA kernels take.

NumPy only (no Paddle, no service imports): the GPU harness (tests/gpu/) runs on machines with
CuPy and PyTorch but no Paddle. tests/integration/test_kernel_reference.py checks each reference
against the pure-Paddle path (worker.kernels.selection.PaddleKernels and build_step_inputs), which the
CPU custom ops are tested against, so CPU and GPU kernels answer to the same thing.

bfloat16 has no NumPy type: its arrays are uint16 bit patterns (`to_bf16_bits`, `from_bf16_bits`).
"""

from __future__ import annotations

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}  # the C entry points' dtype argument
# Relative/absolute tolerances against the float32/float64 reference, per element type: a few
# roundings to the type's precision (bf16: 8 bits of mantissa, fp16: 11).
TOLERANCES = {"float32": (1e-4, 1e-5), "bfloat16": (3e-2, 3e-2), "float16": (5e-3, 5e-3)}


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (as CUDA's __float2bfloat16)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the kernel's element type (bf16 as bits)."""
    if dtype == "bfloat16":
        return to_bf16_bits(values)
    return np.ascontiguousarray(values, dtype=np.float16 if dtype == "float16" else np.float32)


def decode(stored: np.ndarray, dtype: str) -> np.ndarray:
    """The kernel's elements as float32."""
    return from_bf16_bits(stored) if dtype == "bfloat16" else np.asarray(stored, dtype=np.float32)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to the element type's precision, as float32."""
    return decode(encode(values, dtype), dtype)


def add_rms_norm(x, residual, weight, eps: float, dtype: str = "float32"):
    """(out, summed): summed = x + residual rounded to dtype (x when residual is None), out =
    summed * rsqrt(mean(summed^2) + eps) * weight; inputs and outputs float32 holding dtype values."""
    summed = x if residual is None else rounded(x.astype(np.float32) + residual, dtype)
    summed = summed.astype(np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(summed * summed, axis=-1, keepdims=True) + eps)
    return (summed * inv_rms * weight).astype(np.float32), summed.astype(np.float32)


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    gate, up = np.split(gate_up.astype(np.float64), 2, axis=-1)
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)


def rope_tables(max_positions: int, head_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_positions, head_dim] as worker/layers/rotary.py builds them for the default rope."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.float32(theta) ** exponents).astype(np.float32)
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Hugging Face rotary embedding of x [tokens, heads, dim] with cos/sin [tokens, dim]."""
    half = x.shape[-1] // 2
    rotated_half = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


def rope_write_kv(qkv, positions, cos, sin, slot_mapping, key_cache, value_cache, num_heads: int, num_kv_heads: int):
    """Rotated query [tokens, heads, dim]; writes the rotated keys and the values into copies of the
    caches [num_blocks, block_size, kv_heads, dim] at the slots. Returns (query, key_cache, value_cache)."""
    dim = key_cache.shape[-1]
    qkv = qkv.astype(np.float64)
    query, key, value = np.split(qkv, [num_heads * dim, (num_heads + num_kv_heads) * dim], axis=1)
    rows_cos, rows_sin = cos[positions].astype(np.float64), sin[positions].astype(np.float64)
    keys_out, values_out = key_cache.copy(), value_cache.copy()
    slots = keys_out.reshape(-1, num_kv_heads, dim), values_out.reshape(-1, num_kv_heads, dim)
    slots[0][slot_mapping] = rotate(key.reshape(-1, num_kv_heads, dim), rows_cos, rows_sin)
    slots[1][slot_mapping] = value.reshape(-1, num_kv_heads, dim)
    query = rotate(query.reshape(-1, num_heads, dim), rows_cos, rows_sin)
    return query.astype(np.float32), keys_out, values_out


def paged_attention(
    query, key_cache, value_cache, query_start, context_lens, block_table, sliding_window: int = 0, softcap: float = 0.0
) -> np.ndarray:
    """Causal attention [tokens, heads * dim] of query [tokens, heads, dim] over each request's cache
    blocks: request r's queries are rows query_start[r]..query_start[r + 1], at the last positions of its
    context_lens[r] tokens; head h reads kv head h // (heads / kv_heads). With Hugging Face's sliding window (the
    query at position p sees keys p - sliding_window < k <= p; 0: no window) and soft-capping (scores s ->
    softcap * tanh(s / softcap); 0: none). Computed in float64."""
    num_tokens, num_heads, dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros((num_tokens, num_heads, dim))
    for request, context in enumerate(context_lens):
        key_positions = np.arange(context)
        blocks = block_table[request, key_positions // block_size]
        keys = np.repeat(key_cache[blocks, key_positions % block_size].astype(np.float64), group, axis=1)
        values = np.repeat(value_cache[blocks, key_positions % block_size].astype(np.float64), group, axis=1)
        first, last = query_start[request], query_start[request + 1]
        query_positions = context - (last - first) + np.arange(last - first)
        offsets = query_positions[:, None] - key_positions[None, :]
        visible = (offsets >= 0) & ((offsets < sliding_window) if sliding_window > 0 else True)
        scores = np.einsum("khd,qhd->qhk", keys, query[first:last].astype(np.float64)) / np.sqrt(dim)
        if softcap > 0:
            scores = softcap * np.tanh(scores / softcap)
        scores = np.where(visible[:, None, :], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out[first:last] = np.einsum("qhk,khd->qhd", probs, values)
    return out.reshape(num_tokens, num_heads * dim).astype(np.float32)


def step_inputs_from_delta(
    delta: np.ndarray, num_requests: int, num_tokens: int, block_tables, last_sampled, block_size: int, table_width: int
) -> dict[str, np.ndarray]:
    """What the device step-input kernels make of a step delta (worker/inputs/step_delta.py's layout);
    appends the new blocks to `block_tables` in place."""
    from worker.inputs.step_delta import StepRecord

    records = delta[: num_requests * len(StepRecord)].reshape(num_requests, len(StepRecord))
    out = {
        name: np.zeros(size, dtype=np.int64)
        for name, size in (("input_ids", num_tokens), ("positions", num_tokens), ("slot_mapping", num_tokens))
    }
    out["block_table"] = np.zeros((num_requests, table_width), dtype=np.int64)
    for request, record in enumerate(records):
        slot, before, count = (
            record[StepRecord.SLOT],
            record[StepRecord.NUM_BLOCKS_BEFORE],
            record[StepRecord.NUM_NEW_BLOCKS],
        )
        offset = record[StepRecord.NEW_BLOCKS_OFFSET]
        block_tables[slot, before : before + count] = delta[offset : offset + count]
    for request, record in enumerate(records):
        slot, first = record[StepRecord.SLOT], record[StepRecord.QUERY_START]
        local = np.arange(record[StepRecord.NUM_SCHEDULED])
        positions = record[StepRecord.NUM_COMPUTED] + local
        known = record[StepRecord.NUM_KNOWN_TOKENS]
        tokens = delta[record[StepRecord.KNOWN_TOKENS_OFFSET] + local[:known]]
        rows = slice(first, first + len(local))
        out["positions"][rows] = positions
        out["slot_mapping"][rows] = block_tables[slot, positions // block_size] * block_size + positions % block_size
        out["input_ids"][rows] = np.concatenate([tokens, np.full(len(local) - known, last_sampled[slot])])
        held = record[StepRecord.NUM_BLOCKS_BEFORE] + record[StepRecord.NUM_NEW_BLOCKS]
        out["block_table"][request, :held] = block_tables[slot, :held]
    out["query_start"] = np.append(records[:, StepRecord.QUERY_START], num_tokens)
    out["context_lens"] = records[:, StepRecord.NUM_COMPUTED] + records[:, StepRecord.NUM_SCHEDULED]
    return out
