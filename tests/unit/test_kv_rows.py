"""The 8-bit KV rows' NumPy reference (worker/attention/kv_rows.py): fp8 e4m3 codes as PyTorch rounds them, each
value within half a code step of its row's scale, the scale a bf16 no code overflows, and the blocks a cache holds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from worker.attention.kv_cache import block_bytes
from worker.attention.kv_rows import (
    KV_ROW_FORMATS,
    decode_rows,
    e4m3_values,
    encode_rows,
    int8_cache_in_groups,
    rows_in_groups,
    rows_of_groups,
)
from worker.kernels.cpu_isa import IsaSet


def rows(seed: int, shape=(7, 3, 64)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 50, shape[:-1] + (1,)).astype(np.float32)
    x[0, 0] = 0.0  # a zero row
    x[1, 0, 5] = 1e4  # an outlier
    return x


def test_every_e4m3_code_decodes_as_pytorch_decodes_it():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)  # all but the NaNs
    expected = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(e4m3_values(codes), expected)


@pytest.mark.parametrize("seed", range(3))
def test_fp8_codes_are_pytorchs_rounding_of_the_scaled_values(seed):
    x = rows(seed)
    encoded = encode_rows(x, "fp8_e4m3")
    scale = decode_rows(np.concatenate([np.full(x.shape, 0x38, np.uint8), encoded[..., -2:]], axis=-1), "fp8_e4m3")
    scale = scale[..., 0]  # code 0x38 is 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(scale[..., None] > 0, x * (np.float32(1) / scale)[..., None], 0).astype(np.float32)
    expected = torch.from_numpy(scaled).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.abs(scaled).max() <= 448
    np.testing.assert_array_equal(encoded[..., :-2], expected)


@pytest.mark.parametrize("kv_cache_dtype, step", [("int8", 1 / 127), ("fp8_e4m3", 2.0**-3)])
def test_a_row_decodes_within_half_a_step_and_its_scale_lets_no_code_overflow(kv_cache_dtype, step):
    x = rows(7)
    encoded = encode_rows(x, kv_cache_dtype)
    assert encoded.shape == x.shape[:-1] + (x.shape[-1] + 2,) and encoded.dtype == np.uint8
    decoded = decode_rows(encoded, kv_cache_dtype)
    largest = np.abs(x).max(axis=-1, keepdims=True)
    scale_bits = np.ascontiguousarray(encoded[..., -2:]).view(np.uint16)
    scale = (scale_bits.astype(np.uint32) << 16).view(np.float32)
    top = KV_ROW_FORMATS[kv_cache_dtype].top_code
    assert np.all(scale >= largest / top) and np.all(scale <= largest / top * (1 + 2.0**-7))
    if kv_cache_dtype == "int8":  # a uniform step: half of it, of the row's scale
        bound = scale / 2
    else:  # half a mantissa step (a value's step is at most 2^-3 of it), or of the subnormals' step
        bound = np.maximum(np.abs(x) * step / 2, scale * 2.0**-9)
    assert np.all(np.abs(decoded - x) <= bound * (1 + 1e-6))
    assert np.all(decoded[0, 0] == 0)


def test_an_8bit_cache_holds_more_than_1_9_times_the_blocks_of_bfloat16_in_the_same_memory():
    config = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's attention
    bf16 = block_bytes(config, 16, "bfloat16")
    for kv_cache_dtype in ("int8", "fp8_e4m3"):
        assert bf16 / block_bytes(config, 16, kv_cache_dtype) >= 1.9
    assert block_bytes(config, 16, "float32") == 2 * bf16


@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("block_size, kv_heads, head_dim", [(16, 3, 64), (32, 2, 80)])
def test_an_int8_cache_in_groups_holds_each_byte_of_a_row_where_kv_types_h_places_it(
    kind, block_size, kv_heads, head_dim
):
    """Every row's byte at the offset custom_ops/cpu/kv_types.h gives (Int8Groups), from element indices: group
    (slot // 16) * kv_heads + head of 16 * (head_dim + 2) bytes; a key's dim d at (d // 4) * 64 + lane * 4 + d % 4, a
    value's at (lane // 4) * 4 * head_dim + d * 4 + lane % 4, the scale's 2 bytes at 16 * head_dim + 2 * lane; and
    rows_of_groups undoes it."""
    num_blocks, row = 3, head_dim + 2
    index = np.arange(num_blocks * block_size * kv_heads * row).reshape(num_blocks, block_size, kv_heads, row)
    grouped = rows_in_groups(index, kind).reshape(-1)
    for slot in range(num_blocks * block_size):
        lane = slot % 16
        for head in range(kv_heads):
            base = ((slot // 16) * kv_heads + head) * 16 * row
            of_row = index.reshape(-1, kv_heads, row)[slot, head]
            for d in range(head_dim):
                if kind == "key":
                    at = (d // 4) * 64 + lane * 4 + d % 4
                else:
                    at = (lane // 4) * 4 * head_dim + d * 4 + lane % 4
                assert grouped[base + at] == of_row[d]
            assert grouped[base + 16 * head_dim + 2 * lane] == of_row[head_dim]
            assert grouped[base + 16 * head_dim + 2 * lane + 1] == of_row[head_dim + 1]
    np.testing.assert_array_equal(
        rows_of_groups(grouped.reshape(index.shape).astype(np.uint8), kind), index.astype(np.uint8)
    )


def test_only_the_vnni_kernels_keep_int8_caches_in_groups_and_only_blocks_of_16_slots():
    vnni = IsaSet(avx512=True, bf16=True, vnni=True)
    assert int8_cache_in_groups(vnni, 16, 64) and int8_cache_in_groups(vnni, 32, 80)
    assert not int8_cache_in_groups(vnni, 8, 64) and not int8_cache_in_groups(vnni, 24, 64)
    assert not int8_cache_in_groups(IsaSet(avx512=True), 16, 64) and not int8_cache_in_groups(IsaSet(), 16, 64)
