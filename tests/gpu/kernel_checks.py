"""Each CUDA kernel against the NumPy references (tests/support/kernel_reference.py), written once
and run twice: on a GPU (tests/gpu/test_cuda_kernels.py) and emulated on the CPU
(tests/integration/test_cuda_kernels_emulated.py). A check takes a KernelLibrary and an element type;
the attention's checks also run over 8-bit KV caches (for_kv_cache), whose rows are
worker/attention/kv_rows.py's."""

from __future__ import annotations

import numpy as np

from tests.support import kernel_reference as ref
from worker.attention.kv_rows import EIGHT_BIT, KV_ROW_FORMATS, decode_rows, encode_rows
from worker.inputs.step_delta import ScheduledRequest, pack_step_delta

# (num_cached, num_new) per request: decodes, a fresh prefill longer than a query tile, prefill chunks,
# a context over many key tiles, a block-sized chunk (as tests/integration/test_custom_ops.py's mixed_step).
MIXED_SHAPES = [(9, 1), (0, 40), (5, 1), (37, 7), (0, 1), (300, 1), (32, 20), (13, 3)]
# (num_heads, num_kv_heads, head_dim, block_size): GQA groups of 3, 1, 4 and 8, odd block sizes.
ATTENTION_GEOMETRIES = [(9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 32, 5), (32, 4, 128, 16)]


def assert_close(got: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
    rtol, atol = ref.TOLERANCES[dtype]
    np.testing.assert_allclose(ref.decode(got, dtype), expected, rtol=rtol, atol=atol, err_msg=f"{what} ({dtype})")


def stored(rng, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    """Random values in the kernel's storage type."""
    return ref.encode(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)


def stored_cache(rng, shape, dtype: str, kv_cache_dtype: str | None) -> tuple[np.ndarray, np.ndarray]:
    """A random cache [..., head_dim] as the kernels hold it, and its values as float32: in the activations' dtype
    (kv_cache_dtype None) or as 8-bit rows of uint8 [..., head_dim + 2]."""
    if kv_cache_dtype is None:
        cache = stored(rng, shape, dtype)
        return cache, ref.decode(cache, dtype)
    rows = encode_rows(rng.standard_normal(shape, dtype=np.float32), kv_cache_dtype)
    return rows, decode_rows(rows, kv_cache_dtype)


def for_kv_cache(check, kv_cache_dtype: str):
    """`check` over KV caches of `kv_cache_dtype` rather than the activations' dtype."""

    def check_with_kv_cache(library, dtype: str) -> None:
        check(library, dtype, kv_cache_dtype)

    check_with_kv_cache.__name__ = f"{check.__name__}_{kv_cache_dtype}_cache"
    check_with_kv_cache.kv_cache_dtype = kv_cache_dtype
    return check_with_kv_cache


def check_add_rms_norm(library, dtype: str) -> None:
    rng = np.random.default_rng(11)
    for rows, width in [(1, 576), (7, 64), (33, 72), (5, 37), (3, 4096)]:
        x, residual = stored(rng, (rows, width), dtype, 3.0), stored(rng, (rows, width), dtype, 3.0)
        weight = stored(rng, width, dtype)
        out, summed = library.add_rms_norm(x, None, weight, 1e-5, dtype)
        expected, _ = ref.add_rms_norm(ref.decode(x, dtype), None, ref.decode(weight, dtype), 1e-5, dtype)
        assert summed is None
        assert_close(out, expected, dtype, f"rms_norm {rows}x{width}")
        out, summed = library.add_rms_norm(x, residual, weight, 1e-5, dtype)
        expected, expected_summed = ref.add_rms_norm(
            ref.decode(x, dtype), ref.decode(residual, dtype), ref.decode(weight, dtype), 1e-5, dtype
        )
        assert_close(out, expected, dtype, f"add_rms_norm {rows}x{width}")
        # The stored residual is x + residual rounded once to the element type: exact.
        np.testing.assert_array_equal(ref.decode(summed, dtype), expected_summed)


def check_silu_and_mul(library, dtype: str) -> None:
    rng = np.random.default_rng(12)
    for rows, width in [(1, 1536), (9, 40), (4, 13), (300, 256)]:
        gate_up = stored(rng, (rows, 2 * width), dtype, 6.0)
        expected = ref.silu_and_mul(ref.decode(gate_up, dtype))
        assert_close(library.silu_and_mul(gate_up, dtype), expected, dtype, f"silu_and_mul {rows}x{width}")


def mixed_batch(rng, block_size: int, shapes=MIXED_SHAPES, share_blocks: bool = True) -> dict[str, np.ndarray]:
    """A step's attention inputs: block ids scattered over the cache (odd ids only: holes in every table),
    request 6 reusing request 3's first two blocks (if share_blocks), the table padded with block 0."""
    lengths = [cached + new for cached, new in shapes]
    num_blocks = 2 * sum(-(-length // block_size) for length in lengths) + 2
    free = list(rng.permutation(np.arange(1, num_blocks, 2)))
    tables = [[int(free.pop()) for _ in range(-(-length // block_size))] for length in lengths]
    if share_blocks:
        tables[6][:2] = tables[3][:2]
    block_table = np.zeros((len(shapes), max(len(t) for t in tables)), dtype=np.int64)
    for row, blocks in enumerate(tables):
        block_table[row, : len(blocks)] = blocks
    query_lens = np.array([new for _, new in shapes], dtype=np.int64)
    context_lens = np.array(lengths, dtype=np.int64)
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    request = np.repeat(np.arange(len(shapes)), query_lens)
    positions = context_lens[request] - query_lens[request] + np.arange(query_start[-1]) - query_start[request]
    slots = block_table[request, positions // block_size] * block_size + positions % block_size
    return dict(
        num_blocks=num_blocks,
        query_start=query_start,
        context_lens=context_lens,
        block_table=block_table,
        positions=positions.astype(np.int64),
        slot_mapping=slots.astype(np.int64),
    )


# Values halfway between two codes of a row whose scale is 1 (its largest the top code): int8's and e4m3's normal and
# subnormal ties, each to be rounded to the even code.
TIES = [0.5, 1.5, 2.5, -0.5, -2.5, 1.0625, 1.1875, -1.1875, 2.0**-10, 3 * 2.0**-10, -3 * 2.0**-10]


def ties_row(head_dim: int, kv_cache_dtype: str) -> np.ndarray:
    row = np.zeros(head_dim, dtype=np.float32)
    row[0], row[1 : 1 + len(TIES)] = KV_ROW_FORMATS[kv_cache_dtype].top_code, TIES
    return row


def rotated_in_float32(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [tokens, heads, dim] rotated as the kernel rotates a key it writes as an 8-bit row: each product and
    each sum rounded to float32 once (no FMA), so that the row's codes are known to the bit."""
    half = x.shape[-1] // 2
    x1, x2, c, s = x[..., :half], x[..., half:], cos[:, None, :half], sin[:, None, :half]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def check_rope_write_kv(library, dtype: str, kv_cache_dtype: str | None = None) -> None:
    """Queries within the dtype's rounding of the reference. A cache of the dtype: keys likewise, values copied as
    they are. An 8-bit cache: each key (rotated in float32) and value row as encode_rows encodes it, to the bit,
    a token's all-zero values a row of scale 0, another's a row of ties. Either way every slot the step does not
    write keeps its bits."""
    rng = np.random.default_rng(13)
    for num_heads, num_kv_heads, head_dim, block_size in ATTENTION_GEOMETRIES:
        batch = mixed_batch(rng, block_size)
        cos, sin = ref.rope_tables(1024, head_dim)
        tokens = len(batch["positions"])
        qkv = stored(rng, (tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype)
        values_start = (num_heads + num_kv_heads) * head_dim
        qkv[0, values_start:] = 0  # the first token's values
        if kv_cache_dtype is not None:
            qkv[1, values_start : values_start + head_dim] = ref.encode(ties_row(head_dim, kv_cache_dtype), dtype)
        cache_shape = (batch["num_blocks"], block_size, num_kv_heads, head_dim)
        key_cache, key_values = stored_cache(rng, cache_shape, dtype, kv_cache_dtype)
        value_cache, value_values = stored_cache(rng, cache_shape, dtype, kv_cache_dtype)
        query, keys, values = library.rope_write_kv(
            qkv,
            batch["positions"],
            cos,
            sin,
            batch["slot_mapping"],
            key_cache,
            value_cache,
            num_heads,
            num_kv_heads,
            dtype,
            kv_cache_dtype,
        )
        expected_query, expected_keys, expected_values = ref.rope_write_kv(
            ref.decode(qkv, dtype), batch["positions"], cos, sin, batch["slot_mapping"],
            key_values, value_values, num_heads, num_kv_heads,
        )  # fmt: skip
        what = f"rope_write_kv {num_heads}/{num_kv_heads}x{head_dim} {kv_cache_dtype or dtype} cache"
        assert_close(query, expected_query, dtype, what + " query")
        written = batch["slot_mapping"]
        if kv_cache_dtype is None:
            assert_close(keys, expected_keys, dtype, what + " keys")
            np.testing.assert_array_equal(ref.decode(values, dtype), expected_values, err_msg=what)
        else:
            _, new_keys, new_values = np.split(
                ref.decode(qkv, dtype).reshape(tokens, -1, head_dim), [num_heads, num_heads + num_kv_heads], axis=1
            )
            rotated = rotated_in_float32(new_keys, cos[batch["positions"]], sin[batch["positions"]])
            row = head_dim + 2
            np.testing.assert_array_equal(
                keys.reshape(-1, num_kv_heads, row)[written], encode_rows(rotated, kv_cache_dtype), err_msg=what
            )
            np.testing.assert_array_equal(
                values.reshape(-1, num_kv_heads, row)[written], encode_rows(new_values, kv_cache_dtype), err_msg=what
            )
            assert np.all(values.reshape(-1, num_kv_heads, row)[written[0]] == 0), "a zero row: zero codes and scale"
        unwritten = np.setdiff1d(np.arange(batch["num_blocks"] * block_size), written)
        for after, before in ((keys, key_cache), (values, value_cache)):
            flat = after.reshape(-1, num_kv_heads, after.shape[-1])
            np.testing.assert_array_equal(flat[unwritten], before.reshape(flat.shape)[unwritten], err_msg=what)


def attend_and_compare(
    library, dtype, rng, batch, num_heads, num_kv_heads, head_dim, block_size, query_tile, num_sms, kv_cache_dtype=None
):
    """The kernel's attention over random caches (of the dtype, or 8-bit rows) against the reference's over the
    caches' values (an 8-bit cache's decoded rows), within the output dtype's rounding."""
    tokens = len(batch["positions"])
    query = stored(rng, (tokens, num_heads, head_dim), dtype)
    cache_shape = (batch["num_blocks"], block_size, num_kv_heads, head_dim)
    key_cache, keys = stored_cache(rng, cache_shape, dtype, kv_cache_dtype)
    value_cache, values = stored_cache(rng, cache_shape, dtype, kv_cache_dtype)
    inputs = (batch["query_start"], batch["context_lens"], batch["block_table"])
    out, plan = library.paged_attention(
        query, key_cache, value_cache, *inputs, query_tile, dtype, num_sms, kv_cache_dtype=kv_cache_dtype
    )
    expected = ref.paged_attention(ref.decode(query, dtype), keys, values, *inputs)
    what = (
        f"paged_attention {num_heads}/{num_kv_heads}x{head_dim} bs{block_size} {kv_cache_dtype or dtype} cache {plan}"
    )
    assert_close(out, expected, dtype, what)
    return plan


def check_paged_attention_mixed_step(library, dtype: str, kv_cache_dtype: str | None = None) -> None:
    """Decodes and prefill chunks in one call, every GQA geometry, one split per tile."""
    rng = np.random.default_rng(14)
    for num_heads, num_kv_heads, head_dim, block_size in ATTENTION_GEOMETRIES:
        batch = mixed_batch(rng, block_size)
        geometry = (num_heads, num_kv_heads, head_dim, block_size)
        plan = attend_and_compare(library, dtype, rng, batch, *geometry, 16, 1, kv_cache_dtype)
        assert plan["query_tile"] == min(16, 32 // (num_heads // num_kv_heads))


def check_paged_attention_split_keys(library, dtype: str, kv_cache_dtype: str | None = None) -> None:
    """Few long contexts on many multiprocessors: decodes and a prefill chunk split over the keys
    (rows of the chunk see nothing of the later splits), merged by the combine step."""
    rng = np.random.default_rng(15)
    shapes = [(700, 1), (1000, 1), (600, 20)]
    for geometry in [(8, 2, 64, 16), (4, 4, 32, 5)]:
        batch = mixed_batch(rng, geometry[3], shapes + [(0, 1)] * 5)  # mixed_batch's sharing wants 8 requests
        plan = attend_and_compare(library, dtype, rng, batch, *geometry, 16, 132, kv_cache_dtype)
        assert plan["max_splits"] > 1 and plan["workspace_floats"] > 0, plan


def poisoned_rows(shape, dtype: str, kv_cache_dtype: str | None) -> np.ndarray:
    """Cache rows [kv_heads, row] whose values are NaN: NaN elements, or 8-bit rows whose scale is a NaN bf16."""
    if kv_cache_dtype is None:
        return ref.encode(np.full(shape, np.nan, dtype=np.float32), dtype)
    rows = np.zeros(shape, dtype=np.uint8)
    rows[..., -2:] = np.array([0x7FC0], dtype=np.uint16).view(np.uint8)
    return rows


def poison_unseen_keys(key_cache, value_cache, batch, sliding_window: int, dtype: str, kv_cache_dtype=None) -> None:
    """NaN keys and values at every position before the window of each request's first query: a kernel
    that reads one of them (even to mask it: 0 * NaN) answers NaN. Needs tables that share no block."""
    poison = poisoned_rows(key_cache.shape[2:], dtype, kv_cache_dtype)
    block_size = key_cache.shape[1]
    query_lens = np.diff(batch["query_start"])
    for request, context in enumerate(batch["context_lens"]):
        for position in range(max(0, context - query_lens[request] - sliding_window + 1)):
            block = batch["block_table"][request, position // block_size]
            key_cache[block, position % block_size] = value_cache[block, position % block_size] = poison


def attend_windowed_and_compare(
    library, dtype, rng, batch, geometry, query_tile, num_sms, sliding_window, softcap, kv_cache_dtype=None
):
    """As attend_and_compare with a window and soft-capping; the queries are scaled up so that the cap bites."""
    num_heads, num_kv_heads, head_dim, block_size = geometry
    query = stored(rng, (len(batch["positions"]), num_heads, head_dim), dtype, 3.0)
    cache_shape = (batch["num_blocks"], block_size, num_kv_heads, head_dim)
    key_cache, keys = stored_cache(rng, cache_shape, dtype, kv_cache_dtype)
    value_cache, values = stored_cache(rng, cache_shape, dtype, kv_cache_dtype)
    inputs = (batch["query_start"], batch["context_lens"], batch["block_table"])
    decoded = [ref.decode(query, dtype), keys, values]
    expected = ref.paged_attention(*decoded, *inputs, sliding_window, softcap)
    plain = ref.paged_attention(*decoded, *inputs)
    assert not np.allclose(expected, plain, *ref.TOLERANCES[dtype]), "the window and cap must change the answer"
    if sliding_window > 0:
        poison_unseen_keys(key_cache, value_cache, batch, sliding_window, dtype, kv_cache_dtype)
    out, plan = library.paged_attention(
        query, key_cache, value_cache, *inputs, query_tile, dtype, num_sms, sliding_window, softcap, kv_cache_dtype
    )
    what = (
        f"paged_attention {geometry} window {sliding_window} softcap {softcap} {kv_cache_dtype or dtype} cache {plan}"
    )
    assert_close(out, expected, dtype, what)
    return plan


# (sliding_window, softcap): windows alone, soft-capping alone, both.
WINDOW_CASES = [(1, 0.0), (7, 0.0), (16, 0.0), (64, 0.0), (0, 5.0), (7, 5.0), (64, 30.0)]
# Decodes of contexts shorter than, as long as and longer than the windows, a chunk of 20 queries at
# positions 50..69 (past a window of 16's start), a fresh prefill longer than a query tile, a short chunk.
WINDOW_SHAPES = [(0, 1), (4, 1), (6, 1), (7, 1), (63, 1), (64, 1), (299, 1), (50, 20), (0, 40), (130, 3)]


def check_paged_attention_window_and_softcap(library, dtype: str, kv_cache_dtype: str | None = None) -> None:
    """Sliding windows of 1, 7, 16 and 64 keys and soft-capping over decodes and prefill chunks, GQA
    groups of 3 and 4, blocks of 16; keys before a request's first window are NaN (never read)."""
    rng = np.random.default_rng(19)
    for geometry in [(9, 3, 64, 16), (8, 2, 32, 16)]:
        for sliding_window, softcap in WINDOW_CASES:
            batch = mixed_batch(rng, geometry[3], WINDOW_SHAPES, share_blocks=False)
            attend_windowed_and_compare(
                library, dtype, rng, batch, geometry, 16, 1, sliding_window, softcap, kv_cache_dtype
            )


def check_paged_attention_window_splits(library, dtype: str, kv_cache_dtype: str | None = None) -> None:
    """Long decodes with a window of 512 on many multiprocessors: the plan splits the window's keys
    (plus a query tile's), not the context's, and no key before the window is read (NaN there)."""
    rng = np.random.default_rng(20)
    sliding_window = 512
    shapes = [(3999, 1), (2047, 1), (600, 20), (100, 1)]
    for softcap in (0.0, 30.0):
        batch = mixed_batch(rng, 16, shapes, share_blocks=False)
        plan = attend_windowed_and_compare(
            library, dtype, rng, batch, (8, 2, 64, 16), 16, 132, sliding_window, softcap, kv_cache_dtype
        )
        span = sliding_window + plan["query_tile"] - 1
        assert plan["max_splits"] > 1 and (plan["max_splits"] - 1) * plan["split_keys"] < span, plan
        assert plan["max_splits"] * plan["split_keys"] >= span, plan


def check_prepare_step_inputs(library, dtype: str) -> None:
    """Random steps over scattered batch slots: new requests, decodes whose token the step before
    sampled on the device, prefill chunks; the device tables persist from step to step."""
    del dtype  # int64 throughout
    rng = np.random.default_rng(16)
    num_slots, stride, block_size = 40, 24, 8
    tables = np.zeros((num_slots, stride), dtype=np.int64)
    reference_tables = tables.copy()
    held = {}  # slot -> (blocks on the device, tokens computed)
    for _ in range(6):
        last_sampled = rng.integers(1000, 2000, num_slots).astype(np.int64)
        requests = []
        for slot in rng.choice(num_slots, size=12, replace=False):
            blocks_before, computed = held.get(int(slot), (0, 0))
            scheduled = int(rng.choice([1, 1, 5, 17]))
            needed = -(-(computed + scheduled) // block_size)
            if needed > stride:
                blocks_before, computed, needed = 0, 0, -(-scheduled // block_size)
            new_blocks = rng.integers(0, 500, needed - blocks_before).tolist()
            num_known = scheduled - int(scheduled == 1 and computed > 0)  # a decode's token is on the device
            requests.append(
                ScheduledRequest(
                    int(slot), computed, scheduled, blocks_before, new_blocks, rng.integers(0, 999, num_known).tolist()
                )
            )
            held[int(slot)] = (needed, computed + scheduled)
        delta = pack_step_delta(requests)
        outputs, tables = library.prepare_step_inputs(delta, tables, last_sampled, block_size)
        expected = ref.step_inputs_from_delta(
            delta.packed,
            delta.num_requests,
            delta.num_tokens,
            reference_tables,
            last_sampled,
            block_size,
            delta.table_width,
        )
        for name, values in expected.items():
            np.testing.assert_array_equal(outputs[name], values, err_msg=name)
        np.testing.assert_array_equal(tables, reference_tables)


def decode_batch(rng, num_sequences: int, context: int, block_size: int) -> dict[str, np.ndarray]:
    """One decode per sequence, every sequence `context` tokens long, blocks scattered over the cache."""
    blocks_per_sequence = -(-context // block_size)
    num_blocks = num_sequences * blocks_per_sequence
    block_table = rng.permutation(num_blocks).reshape(num_sequences, blocks_per_sequence).astype(np.int64)
    context_lens = np.full(num_sequences, context, dtype=np.int64)
    positions = context_lens - 1
    return dict(
        num_blocks=num_blocks,
        query_start=np.arange(num_sequences + 1, dtype=np.int64),
        context_lens=context_lens,
        block_table=block_table,
        positions=positions,
        slot_mapping=block_table[:, -1] * block_size + positions % block_size,
    )


def check_paged_attention_decode_batch(library, dtype: str, kv_cache_dtype: str | None = None) -> None:
    """64 decodes of 1k tokens, a Llama-3-8B layer's heads: as the GPU is planned for (one split each)."""
    rng = np.random.default_rng(17)
    batch = decode_batch(rng, 64, 1024, 16)
    attend_and_compare(library, dtype, rng, batch, 32, 8, 128, 16, 16, library.arrays.num_sms, kv_cache_dtype)


def check_paged_attention_long_contexts(library, dtype: str) -> None:
    """4 decodes of 16k tokens: split over the keys to fill an H100's 132 multiprocessors."""
    rng = np.random.default_rng(18)
    batch = decode_batch(rng, 4, 16384, 16)
    plan = attend_and_compare(library, dtype, rng, batch, 32, 8, 128, 16, 16, 132)
    assert plan["max_splits"] > 1, plan


# The checks of the kernels that read or write the KV cache: run over a cache of the dtype and of each 8-bit type.
KV_CACHE_CHECKS = [
    check_rope_write_kv,
    check_paged_attention_mixed_step,
    check_paged_attention_split_keys,
    check_paged_attention_window_and_softcap,
    check_paged_attention_window_splits,
]
CHECKS = [
    check_add_rms_norm,
    check_silu_and_mul,
    *KV_CACHE_CHECKS,
    *(for_kv_cache(check, kv_cache_dtype) for check in KV_CACHE_CHECKS for kv_cache_dtype in EIGHT_BIT),
    check_prepare_step_inputs,
]
# Shapes too large for the emulation: on a GPU only.
GPU_ONLY_CHECKS = [
    check_paged_attention_decode_batch,
    *(for_kv_cache(check_paged_attention_decode_batch, kv_cache_dtype) for kv_cache_dtype in EIGHT_BIT),
    check_paged_attention_long_contexts,
]
