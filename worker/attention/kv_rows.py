"""How a KV cache of each BLOCKSERVE_KV_CACHE_DTYPE holds one row (a token's kv head: head_dim values), and a NumPy
reference of the 8-bit rows that the C++ and CUDA kernels write and read (custom_ops/cpu/kv_types.h, kv_element.h;
custom_ops/gpu/kv_rows.cuh).

An 8-bit row is head_dim codes and then the row's scale, a bf16 in 2 more bytes: value = decoded code * scale. The
scale is the row's largest magnitude over the code's largest (127 for int8, 448 for fp8 e4m3), rounded up to a
bf16 so that no code overflows. A scale per row (per token and kv head) is finer than per block: a block's rows
are written a token at a time, and a row's scale never changes once written. The CPU kernels with AVX512-VNNI keep an
int8 cache of blocks of a multiple of 16 tokens in groups: the same bytes, placed for vpdpbusd (rows_in_groups).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KvRowFormat:
    paddle_dtype: str  # the cache tensors' dtype
    element_bytes: int
    scale_elements: int  # elements after a row's head_dim values that hold its scale
    top_code: float = 0.0  # the largest code's magnitude (8-bit rows)

    def row_elements(self, head_dim: int) -> int:
        return head_dim + self.scale_elements

    def row_bytes(self, head_dim: int) -> int:
        return self.row_elements(head_dim) * self.element_bytes


KV_ROW_FORMATS = {
    "float32": KvRowFormat("float32", 4, 0),
    "bfloat16": KvRowFormat("bfloat16", 2, 0),
    "float16": KvRowFormat("float16", 2, 0),
    "int8": KvRowFormat("int8", 1, 2, 127.0),
    "fp8_e4m3": KvRowFormat("uint8", 1, 2, 448.0),  # Paddle's CPU kernels take no float8 tensor (numel)
}
EIGHT_BIT = ("int8", "fp8_e4m3")


def _bf16_at_least(x: np.ndarray) -> np.ndarray:
    """The least bf16 >= x (finite, >= 0), as its 16 bits."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0xFFFF) >> 16).astype(np.uint16)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _e4m3_code(scaled: np.ndarray) -> np.ndarray:
    """fp8 e4m3 codes of 2^120 * scaled (|2^120 * scaled| <= 448), rounded to nearest even: a code's 7 magnitude bits
    are bits 20..26 of 2^-120 times its value as an fp32 (normal and subnormal codes alike)."""
    scaled = np.asarray(scaled, dtype=np.float32).view(np.uint32)
    magnitude = scaled & np.uint32(0x7FFFFFFF)
    rounded = np.minimum((magnitude + np.uint32(0x7FFFF) + ((magnitude >> 20) & 1)) >> 20, 0x7E)
    return (rounded | ((scaled >> 24) & 0x80)).astype(np.uint8)


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """The values of fp8 e4m3 codes (OCP "fn"; NaN codes are never written)."""
    codes = np.asarray(codes, dtype=np.uint8).astype(np.uint32)
    exponent, mantissa = (codes >> 3) & 0xF, (codes & 7).astype(np.float32)
    magnitude = np.where(
        exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * np.exp2(exponent.astype(np.float32) - 7)
    )
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)


def encode_rows(values: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """Rows [..., head_dim] of float32 as an 8-bit cache holds them: uint8 [..., head_dim + 2]."""
    fmt = KV_ROW_FORMATS[kv_cache_dtype]
    values = np.asarray(values, dtype=np.float32)
    largest = np.abs(values).max(axis=-1)
    scale_bits = _bf16_at_least(largest / np.float32(fmt.top_code))
    scale = _bf16_value(scale_bits)
    with np.errstate(divide="ignore"):
        to_code = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    if kv_cache_dtype == "int8":
        codes = np.rint(np.clip(values * to_code[..., None], -127, 127)).astype(np.int8).view(np.uint8)
    else:  # as the kernels compute it: one product by the factor times 2^-120
        codes = _e4m3_code(values * (to_code * np.float32(2.0**-120))[..., None])
    return np.concatenate([codes, scale_bits[..., None].view(np.uint8)], axis=-1)


def row_scales(rows: np.ndarray) -> np.ndarray:
    """float32 [...]: the scale of each 8-bit row uint8 [..., head_dim + 2] (its last two bytes, a bf16)."""
    rows = np.ascontiguousarray(rows).view(np.uint8)
    return _bf16_value(np.ascontiguousarray(rows[..., -2:]).view(np.uint16)[..., 0])


def decode_rows(rows: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """float32 [..., head_dim] of 8-bit rows uint8 [..., head_dim + 2] (encode_rows' or a cache's bytes)."""
    rows = np.ascontiguousarray(rows).view(np.uint8)
    codes, scale = rows[..., :-2], row_scales(rows)
    if kv_cache_dtype == "int8":
        decoded = codes.view(np.int8).astype(np.float32)
    else:
        decoded = e4m3_values(codes)
    return decoded * scale[..., None]


# An int8 cache in groups (custom_ops/cpu/kv_types.h: Int8Groups): the CPU kernels with AVX512-VNNI keep an int8
# cache of 16 consecutive slots per kv head together, laid out for vpdpbusd, where the shape fits. The same bytes as
# the rows (the tensor's shape does not change), placed apart: per group (slot // 16, kv head), 16 * (head_dim + 2)
# bytes: the keys' codes as [head_dim / 4][16 slots][4 dims], the values' as [4 quads][head_dim][4 slots], then the
# 16 rows' scales.
GROUP_SLOTS = 16


def int8_cache_in_groups(isa, block_size: int, head_dim: int) -> bool:
    """Whether the custom CPU kernels of `isa` (worker.kernels.cpu_isa.IsaSet) keep an int8 cache of this shape in
    groups: the kernel sets with AVX512-VNNI (KernelSet::write_int8_groups), blocks of a multiple of 16 slots and a
    head_dim of a multiple of 16 (int8_groups_fit)."""
    return bool(isa.bf16 and isa.vnni) and block_size % GROUP_SLOTS == 0 and head_dim % 16 == 0


def _grouped_codes(codes: np.ndarray, kind: str) -> np.ndarray:
    """A group's codes [..., 16 slots, head_dim] in their order in the group (flattened)."""
    *lead, slots, head_dim = codes.shape
    if kind == "key":
        order = codes.reshape(*lead, slots, head_dim // 4, 4).swapaxes(-3, -2)  # [head_dim / 4, 16, 4]
    else:
        order = codes.reshape(*lead, 4, 4, head_dim).swapaxes(-2, -1)  # [4 quads, head_dim, 4]
    return order.reshape(*lead, slots * head_dim)


def rows_in_groups(rows: np.ndarray, kind: str) -> np.ndarray:
    """An int8 cache's rows uint8 [num_blocks, block_size, kv_heads, head_dim + 2] (encode_rows') as the cache holds
    them in groups, the same shape; `kind` "key" or "value"."""
    num_blocks, block_size, kv_heads, row = rows.shape
    by_group = rows.reshape(-1, GROUP_SLOTS, kv_heads, row).swapaxes(1, 2)  # [groups, kv_heads, 16, row]
    codes, scales = by_group[..., :-2], by_group[..., -2:]
    grouped = np.concatenate([_grouped_codes(codes, kind), scales.reshape(*scales.shape[:2], -1)], axis=-1)
    return np.ascontiguousarray(grouped).reshape(num_blocks, block_size, kv_heads, row)


def rows_of_groups(cache: np.ndarray, kind: str) -> np.ndarray:
    """rows_in_groups undone: a cache's bytes in groups as its rows, [num_blocks, block_size, kv_heads, row]."""
    num_blocks, block_size, kv_heads, row = cache.shape
    head_dim = row - 2
    grouped = np.ascontiguousarray(cache).view(np.uint8).reshape(-1, kv_heads, GROUP_SLOTS * row)
    codes, scales = grouped[..., : GROUP_SLOTS * head_dim], grouped[..., GROUP_SLOTS * head_dim :]
    if kind == "key":
        by_slot = codes.reshape(*codes.shape[:2], head_dim // 4, GROUP_SLOTS, 4).swapaxes(-3, -2)
    else:
        by_slot = codes.reshape(*codes.shape[:2], 4, head_dim, 4).swapaxes(-2, -1)
    by_slot = by_slot.reshape(*codes.shape[:2], GROUP_SLOTS, head_dim)
    rows = np.concatenate([by_slot, scales.reshape(*scales.shape[:2], GROUP_SLOTS, 2)], axis=-1)
    return np.ascontiguousarray(rows.swapaxes(1, 2)).reshape(num_blocks, block_size, kv_heads, row)
