"""blockserve's custom CPU ops against the pure-Paddle kernels they replace, on both instruction sets,
and the fallback to pure Paddle where they cannot build or run."""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

import worker.kernels.selection as kernels_module
from service.contract import wire
from tests.support.api_peer import ApiPeer
from tests.support.isa_kernels import ISA_CAPS, custom_kernels_on
from tests.support.numerics import attention_config, bf16_rounded, int8_query_rows, int8_weights_error_bound
from tests.support.processes import ROOT, loopback_env, metric_samples, start, stop_all
from worker.attention.backend import LayerAttention
from worker.attention.custom_kernels import CustomPagedAttention
from worker.attention.kv_rows import (
    EIGHT_BIT,
    KV_ROW_FORMATS,
    decode_rows,
    encode_rows,
    int8_cache_in_groups,
    rows_in_groups,
    rows_of_groups,
)
from worker.attention.reference import PagedAttentionBackend
from worker.inputs.step_inputs import RequestState, build_step_inputs
from worker.kernels.cpu_ops import load_ops
from worker.kernels.op_build import CustomOpsUnavailable
from worker.kernels.reference import PaddleKernels
from worker.kernels.selection import select_kernels
from worker.layers.rotary import RotaryEmbedding
from worker.sample.sampler import Sampler

MAX_POSITIONS = 1024


@pytest.fixture(scope="module", params=ISA_CAPS)
def custom(request):
    """The custom kernels on one instruction set (tests/support/isa_kernels.py): AVX2 forced, AVX-512F alone, AVX-512
    with AVX512-BF16 (its kernel set scores a bf16 cache's keys with vdpbf16ps) without AMX, or all this CPU has,
    where it includes AMX (its GEMMs on tiles), each where the CPU has it."""
    kernels = custom_kernels_on(request.param)
    assert kernels.name == "custom"
    return kernels


def tensor(array: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(np.ascontiguousarray(array))


@pytest.mark.parametrize("rows, width", [(1, 576), (7, 64), (33, 72), (5, 37)])
def test_add_rms_norm_matches_paddle_with_and_without_residual(custom, rows, width):
    rng = np.random.default_rng(width)
    x, residual = (rng.standard_normal((rows, width), dtype=np.float32) * 3 for _ in range(2))
    weight = rng.standard_normal(width, dtype=np.float32)
    for res in (None, tensor(residual)):
        ours = custom.add_rms_norm(tensor(x), tensor(weight), res, 1e-5)
        reference = PaddleKernels().add_rms_norm(tensor(x), tensor(weight), res, 1e-5)
        for got, expected in zip(ours, reference):
            np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, width", [(1, 1536), (9, 40), (4, 13)])
def test_silu_and_mul_matches_paddle_on_the_fused_gate_up_layout(custom, rows, width):
    gate_up = np.random.default_rng(rows).standard_normal((rows, 2 * width), dtype=np.float32) * 6
    ours = custom.silu_and_mul(tensor(gate_up)).numpy()
    np.testing.assert_allclose(ours, PaddleKernels().silu_and_mul(tensor(gate_up)).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, width", [(1, 1), (3, 17), (64, 49152), (5, 1000)])
def test_argmax_rows_is_numpy_argmax_first_of_ties_and_never_a_nan(custom, rows, width):
    rng = np.random.default_rng(rows * width)
    x = rng.standard_normal((rows, width), dtype=np.float32)
    if width > 8:
        x[0, [3, width - 2]] = x[0].max() + 1  # a tie: the first wins
        x[1 % rows, 5] = np.nan  # a NaN never wins
        x[2 % rows, : width // 2] = -np.inf
    ours = custom.argmax_rows(tensor(x)).numpy()
    assert ours.dtype == np.int64
    np.testing.assert_array_equal(ours, np.nanargmax(np.where(np.isnan(x), -np.inf, x), axis=-1))
    assert custom.argmax_rows(tensor(np.full((2, width), np.nan, np.float32))).numpy().tolist() == [0, 0]


def numpy_draw(logits: np.ndarray, params: np.ndarray) -> np.ndarray:
    """The draw bs_sample_rows makes, in float64 NumPy: softmax(logits / temperature) without the tokens under
    min_p times the top probability; without top_k/top_p the first token (in id order) whose cumulative mass
    exceeds uniform * total, else the same walk over the top_k largest (largest first) cut to the smallest
    prefix holding top_p of their mass."""
    tokens = []
    for row, (temperature, min_p, uniform, top_k, top_p) in zip(logits.astype(np.float64), params):
        scaled = row / np.float32(temperature)
        probs = np.exp(scaled - scaled.max())
        probs[probs < min_p * probs.max()] = 0.0
        order = np.arange(len(row))
        if top_k > 0 or top_p < 1.0:
            order = np.lexsort((order, -row))[: int(top_k) or len(row)]  # largest first, ties by id
            before = np.cumsum(probs[order]) - probs[order]
            order = order[(before < top_p * probs[order].sum()) | (np.arange(len(order)) == 0)]
        cdf = np.cumsum(probs[order])
        tokens.append(order[min(int(np.searchsorted(cdf, uniform * cdf[-1], side="right")), len(order) - 1)])
    return np.array(tokens)


def draw_params(rng, rows: int, top_k=0, top_p=1.0) -> np.ndarray:
    """Rows of (temperature, min_p, uniform, top_k, top_p): temperatures both sides of 1, min_p off and on."""
    temperatures = rng.uniform(0.3, 2.0, rows)
    min_ps = np.where(np.arange(rows) % 2 == 0, 0.0, rng.uniform(0.0, 0.2, rows))
    return np.stack([temperatures, min_ps, rng.random(rows), np.full(rows, top_k), np.full(rows, top_p)], axis=1)


@pytest.mark.parametrize("rows, width", [(1, 1), (3, 17), (64, 49152), (40, 1000), (9, 37)])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (50, 1.0), (0, 0.9), (20, 0.5), (0, 0.0)])
def test_sample_rows_draws_what_numpy_and_the_paddle_reference_draw(custom, rows, width, top_k, top_p):
    """Every row of every shape (widths past the last whole vector and group too), in id order and truncated,
    against the float64 NumPy draw and the Paddle ops the op replaces: the same token (they part only where a
    rounding moves a boundary, for uniforms this rare: none of these rows). -inf logits are never drawn."""
    rng = np.random.default_rng(rows * width + top_k)
    logits = (rng.standard_normal((rows, width)) * 3).astype(np.float32)
    if width > 8:
        logits[0, : width // 3] = -np.inf
    params = draw_params(rng, rows, top_k, top_p)
    ours = custom.sample_rows(tensor(logits), params).numpy()

    assert ours.dtype == np.int64
    np.testing.assert_array_equal(ours, numpy_draw(logits, params))
    np.testing.assert_array_equal(ours, PaddleKernels().sample_rows(tensor(logits), params).numpy())
    if width > 8:
        assert ours[0] >= width // 3


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (0, 0.99), (50, 1.0), (2000, 0.95)])
def test_sample_rows_draws_flat_rows_as_numpy_does(custom, top_k, top_p):
    """Flat rows (a high temperature over close logits): top_p keeps most of the vocabulary, so the op bins
    every entry (its first binning, of the masses >= 2^-8, does not hold top_p), a bin holds hundreds of
    entries and the walks gather and sort bins deep in the row. The same tokens as the NumPy draw."""
    rng = np.random.default_rng(top_k + int(top_p * 100))
    logits = rng.standard_normal((16, 49152)).astype(np.float32)
    params = draw_params(rng, 16, top_k, top_p)
    params[:, 0] = rng.uniform(1.0, 3.0, 16)

    np.testing.assert_array_equal(custom.sample_rows(tensor(logits), params).numpy(), numpy_draw(logits, params))


def test_sample_rows_mixes_truncated_and_id_order_rows_and_keeps_their_order(custom):
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((30, 500)) * 2).astype(np.float32)
    params = draw_params(rng, 30)
    params[::3, 3], params[1::3, 4] = 10, 0.8  # top_k rows, top_p rows, plain rows

    ours = custom.sample_rows(tensor(logits), params).numpy()

    np.testing.assert_array_equal(ours, numpy_draw(logits, params))
    np.testing.assert_array_equal(ours, PaddleKernels().sample_rows(tensor(logits), params).numpy())


def test_sample_rows_edges_and_bad_parameters(custom):
    logits = np.random.default_rng(0).standard_normal((4, 300)).astype(np.float32)
    top = logits.argmax(axis=-1)
    cases = {
        "min_p 1 keeps the top token alone": ([1.0, 1.0, None, 0, 1.0], top),
        "top_k 1 keeps the top token alone": ([1.0, 0.0, None, 1, 1.0], top),
        "top_p 0 keeps the top token alone": ([1.0, 0.0, None, 0, 0.0], top),
        "uniform 0 in id order: the first token": ([1.0, 0.0, 0.0, 0, 1.0], np.zeros(4, dtype=np.int64)),
        "uniform 0 truncated: the top token": ([1.0, 0.0, 0.0, 0, 0.99], top),
    }
    for name, (row, expected) in cases.items():
        params = np.array([[u if value is None else value for value in row] for u in (0.0, 0.3, 0.6, 0.99)])
        np.testing.assert_array_equal(custom.sample_rows(tensor(logits), params).numpy(), expected, err_msg=name)
    nan_rows = np.full((2, 300), np.nan, np.float32)
    nan_rows[1, 7] = 1.0  # NaNs never drawn; a row of NaNs alone falls back to argmax's 0
    for top_k in (0, 5):
        drawn = custom.sample_rows(tensor(nan_rows), np.array([[1.0, 0.0, 0.5, top_k, 1.0]] * 2)).numpy()
        assert drawn.tolist() == [0, 7]
    bad_rows = ([0.0, 0.0, 0.5, 0, 1.0], [1.0, 1.5, 0.5, 0, 1.0], [1.0, 0.0, 1.0, 0, 1.0], [np.nan, 0.0, 0.5, 0, 1.0])
    for bad in (*bad_rows, [1.0, 0.0, 0.5, 2.5, 1.0], [1.0, 0.0, 0.5, -1, 1.0], [1.0, 0.0, 0.5, 0, -0.1]):
        with pytest.raises(OSError, match="temperature > 0, min_p in"):  # a PD_CHECK
            custom.sample_rows(tensor(logits[:1]), np.array([bad]))


def test_the_sampler_on_the_custom_draw_picks_the_paddle_samplers_tokens(custom):
    """A batch of every kind of request: greedy (argmax), draws in id order and truncated (the op), seeded, min_p."""
    rng = np.random.default_rng(5)
    kinds = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.7, "seed": 11},
        {"temperature": 1.3, "min_p": 0.05},
        {"temperature": 1.0, "top_k": 20, "top_p": 0.9},
        {"temperature": 0.8, "top_p": 0.7},
    ]
    requests = [
        RequestState(f"r{i}", [1, 2, 3], 3, wire.SamplingParams(**kinds[i % len(kinds)]), [], 3) for i in range(40)
    ]
    logits = tensor((rng.standard_normal((40, 1000)) * 2).astype(np.float32))
    custom_sampler = Sampler(seed=3, argmax=custom.argmax_rows, sample_rows=custom.sample_rows)

    ours = [t.token_id for t in custom_sampler.sample(logits, requests)]
    reference = [t.token_id for t in Sampler(seed=3).sample(logits, requests)]

    assert ours == reference


def mixed_step(rng, block_size: int, num_blocks: int):
    """Decodes, a fresh prefill longer than a query tile, prefill chunks (one whose queries start in one key
    span and end in the next), a context over many key spans, two requests sharing their first blocks,
    block ids scattered over the cache (holes between them)."""
    shapes = [(9, 1), (0, 40), (5, 1), (37, 7), (0, 1), (300, 1), (2 * block_size, 20), (13, 3), (125, 6)]
    free = [int(b) for b in rng.permutation(np.arange(1, num_blocks, 2))]  # odd ids only: holes in every table
    states = []
    for i, (num_cached, num_new) in enumerate(shapes):
        length = num_cached + num_new
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        states.append(RequestState(f"r{i}", list(range(length)), length, wire.SamplingParams(), blocks, num_cached))
    shared = states[3].block_ids[:2]  # request 6 reuses request 3's first two (full, cached) blocks
    states[6].block_ids[:2] = shared
    return build_step_inputs([(s, n) for s, (_, n) in zip(states, shapes)], block_size, num_blocks)


def decode_step(rng, block_size: int, num_blocks: int, length: int):
    """One sequence decoding its `length`th token, its blocks scattered."""
    blocks = [int(b) for b in rng.permutation(np.arange(1, num_blocks, 2))[: -(-length // block_size)]]
    state = RequestState("r0", list(range(length)), length, wire.SamplingParams(), blocks, length - 1)
    return build_step_inputs([(state, 1)], block_size, num_blocks)


def one_decode_step(rng, block_size: int, num_blocks: int):
    """One sequence decoding its 301st token: fewer requests than threads, so its keys are split over the
    threads (each part over several key spans, for every kv head) and the parts merged."""
    if int(os.environ["OMP_NUM_THREADS"]) < 2:  # conftest sets it to the core count
        pytest.skip("one thread: a decode's keys are split only over several threads")
    return decode_step(rng, block_size, num_blocks, length=301)


def short_decode_step(rng, block_size: int, num_blocks: int):
    """One sequence decoding its 40th token: too few keys to split, so each kv head is a tile of its own."""
    return decode_step(rng, block_size, num_blocks, length=40)


DECODE_AND_MIXED_STEPS = [mixed_step, one_decode_step, short_decode_step]


@pytest.mark.parametrize("step", DECODE_AND_MIXED_STEPS)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 32, 5), (8, 4, 32, 8)]
)
def test_rope_cache_write_and_paged_attention_match_the_paddle_backend(
    custom, num_heads, num_kv_heads, head_dim, block_size, step
):
    rng = np.random.default_rng(head_dim)
    num_blocks = 2 * (-(-320 // block_size)) * 8 + 1
    config = attention_config(num_heads, num_kv_heads, head_dim, MAX_POSITIONS)
    rotary = RotaryEmbedding(config.rope, head_dim, MAX_POSITIONS)
    inputs = step(rng, block_size, num_blocks)
    cache = rng.standard_normal((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32)
    qkv = rng.standard_normal((len(inputs.positions), (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)
    results = {}
    for kernels in (custom, PaddleKernels()):
        attention = kernels.attention(config, block_size, rotary)
        key_cache, value_cache = tensor(cache[0]), tensor(cache[1])
        output = attention.attend_qkv(tensor(qkv), key_cache, value_cache, attention.prepare(inputs))
        results[kernels.name] = output.numpy(), key_cache.numpy(), value_cache.numpy()
    for got, expected in zip(results["custom"], results["paddle"]):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)

    def slots(array: np.ndarray) -> np.ndarray:
        return array.reshape(-1, num_kv_heads, head_dim)

    # Each backend wrote the step's keys and values into the step's slots, and nothing else.
    written = inputs.slot_mapping
    unwritten = np.setdiff1d(np.arange(num_blocks * block_size), written)
    keys, values = (slots(part) for part in np.split(qkv[:, num_heads * head_dim :], 2, axis=1))
    at_start = inputs.positions == 0  # position 0 is not rotated
    for name, (_, key_cache, value_cache) in results.items():
        for after, before in ((key_cache, cache[0]), (value_cache, cache[1])):
            np.testing.assert_array_equal(slots(after)[unwritten], slots(before)[unwritten], err_msg=name)
        np.testing.assert_array_equal(slots(value_cache)[written], values, err_msg=name)  # as projected
        written_keys = slots(key_cache)[written]  # rotated by position: each head keeps its length
        lengths = np.linalg.norm(written_keys, axis=-1)
        np.testing.assert_allclose(lengths, np.linalg.norm(keys, axis=-1), rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(written_keys[at_start], keys[at_start], rtol=1e-6, err_msg=name)
        turned = ~np.isclose(written_keys, keys).all(axis=(1, 2))
        np.testing.assert_array_equal(turned, ~at_start, err_msg=name)


def write_float_caches(custom, qkv, metadata, rotary, float_caches, num_heads: int, num_kv_heads: int):
    """The step's rotated query, its keys and values written into float32 caches by the op: what the attention
    over a cache of another element type is held to."""
    query, _, _ = custom.ops.bs_rope_write_kv(
        tensor(qkv),
        metadata.positions,
        rotary.cos,
        rotary.sin,
        metadata.slot_mapping,
        *float_caches,
        num_heads,
        num_kv_heads,
        custom.isa.bits,
    )
    return query


@pytest.mark.parametrize("step", DECODE_AND_MIXED_STEPS)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (8, 2, 32, 5), (4, 4, 16, 4), (8, 4, 32, 8)]
)
def test_a_bfloat16_cache_holds_the_rounded_keys_and_attention_reads_them_as_float32(
    custom, num_heads, num_kv_heads, head_dim, block_size, step
):
    """With AVX512-BF16 and head_dim a multiple of 32, the scores multiply the scaled query rounded to bf16
    (vdpbf16ps); elsewhere the query stays float32. The values are summed in float32 either way."""
    rng = np.random.default_rng(head_dim + 1)
    num_blocks = 2 * (-(-320 // block_size)) * 8 + 1
    config = attention_config(num_heads, num_kv_heads, head_dim, MAX_POSITIONS)
    rotary = RotaryEmbedding(config.rope, head_dim, MAX_POSITIONS)
    inputs = step(rng, block_size, num_blocks)
    cache = bf16_rounded(rng.standard_normal((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32))
    qkv = rng.standard_normal((len(inputs.positions), (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)
    attention = custom.attention(config, block_size, rotary)
    metadata = attention.prepare(inputs)
    float_caches = [tensor(cache[0]), tensor(cache[1])]
    bf16_caches = [tensor(cache[0]).astype("bfloat16"), tensor(cache[1]).astype("bfloat16")]

    attention.attend_qkv(tensor(qkv), *float_caches, metadata)
    output = attention.attend_qkv(tensor(qkv), *bf16_caches, metadata).numpy()

    for bf16_cache, float_cache in zip(bf16_caches, float_caches):  # the same values, rounded
        np.testing.assert_array_equal(bf16_cache.astype("float32").numpy(), bf16_rounded(float_cache.numpy()))
    query = write_float_caches(custom, qkv, metadata, rotary, float_caches, num_heads, num_kv_heads)
    widened = [bf16_cache.astype("float32") for bf16_cache in bf16_caches]
    backend = PagedAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
    if not (custom.isa.bf16 and head_dim % 32 == 0):
        expected = backend.attend(query, *widened, backend.prepare(inputs)).numpy()
        np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)
        return
    # vdpbf16ps: the scaled query is rounded to bf16, and so is each probability (relative error <= 2^-8)
    # before it multiplies its value: the output is off by at most 2^-8 of the probability-weighted |values|.
    query = bf16_dot_query(query, head_dim)
    expected = backend.attend(query, *widened, backend.prepare(inputs)).numpy()
    weighted_magnitude = backend.attend(query, widened[0], widened[1].abs(), backend.prepare(inputs)).numpy()
    assert_within_bf16_dot_bound(output, expected, weighted_magnitude)


def test_vector_instructions_appear_only_in_functions_built_for_their_instruction_set():
    """No build-machine arch flag or global -mavx*: the dispatch and Paddle glue are baseline x86-64, AVX
    instructions live only in the avx2/avx512*/amx* kernels, zmm registers only in the avx512* and amx* ones, the
    BF16 and VNNI dot products only in the kernels built for them (the attention's sets are built with both), and
    AMX's tiles only in the AMX GEMM kernels (amx_dequant: INT8 and GGUF panels dequantized to bf16 for tdpbf16ps)
    and the AMX attention kernels (kernels_amx.cc, namespace amx_attention: a bf16 prefill's spans on tiles)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    (library,) = Path(load_ops().__file__).parent.glob("*.so")
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", str(library)], capture_output=True, text=True)
    dot_products = ("vdpbf16ps", "vpdpbusd", "tdpbf16ps", "tdpbsud", "ldtilecfg")
    function, found = "", {"vector": set(), "zmm": set(), **{name: set() for name in dot_products}}
    calls: set[tuple[str, str]] = set()  # (caller, callee)
    for line in listing.stdout.splitlines():
        if header := re.match(r"^[0-9a-f]+ <(.*)>:$", line):
            function = header.group(1)
        elif "\t" in line and (instruction := line.split("\t", 1)[1].split()):
            if instruction[0] == "call" and (callee := re.search(r"<(.*)>$", line)):
                calls.add((function, callee.group(1)))
            if instruction[0].startswith("v") or "%ymm" in line or "%zmm" in line:  # VEX/EVEX-encoded
                found["vector"].add(function)
            if "%zmm" in line:
                found["zmm"].add(function)
            if instruction[0] in dot_products:
                found[instruction[0]].add(function)

    def outside(functions: set[str], *namespaces: str) -> list[str]:
        return [f for f in functions if not any(f"{namespace}::" in f for namespace in namespaces)]

    assert all(found.values()), {name: len(functions) for name, functions in found.items()}
    amx = ("amx_bf16", "amx_dequant", "amx_int8", "amx_attention")  # the GEMMs' kernels, the attention's
    assert outside(found["vector"], "avx2", "avx512", "avx512_bf16", "avx512_vnni", *amx) == []
    assert outside(found["zmm"], "avx512", "avx512_bf16", "avx512_vnni", *amx) == []
    # AMX's: the words past the GEMM's tiles, the attention's decodes
    assert outside(found["vdpbf16ps"], "avx512_bf16", "amx_bf16", "amx_dequant", "amx_attention") == []
    # the attention sets': an int8 cache's keys
    assert outside(found["vpdpbusd"], "avx512_vnni", "avx512_bf16", "amx_attention") == []
    assert outside(found["tdpbf16ps"], "amx_bf16", "amx_dequant", "amx_attention") == []
    assert outside(found["tdpbsud"], "amx_int8") == []
    assert outside(found["ldtilecfg"], "amx_bf16", "amx_dequant", "amx_int8", "amx_attention") == []
    assert any("amx_attention::" in f for f in found["tdpbf16ps"])  # the attention's own tiles
    # the dequantized panels' products: amx_dequant's own amx_bf16_tile, or amx_bf16's where GCC folded the two
    # identical copies into one
    dequant_products = {callee for caller, callee in calls if "amx_dequant::" in caller} & found["tdpbf16ps"]
    assert any("amx_dequant::" in f for f in found["tdpbf16ps"]) or dequant_products


def test_a_failing_build_serves_with_paddle_and_says_so_in_one_line(tmp_path, monkeypatch, caplog):
    (tmp_path / "broken.cc").write_text('#include "paddle/extension.h"\nthis is not C++;\n')
    monkeypatch.setattr(kernels_module, "load_ops", lambda: load_ops(tmp_path))

    with caplog.at_level(logging.WARNING, logger="worker.kernels.selection"):
        choice = select_kernels("auto")

    assert choice.kernels.name == "paddle" and choice.describe()["kernels"] == "paddle"
    (record,) = caplog.records
    assert "pure Paddle" in record.getMessage() and "failed" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_a_cpu_without_avx2_never_loads_the_custom_ops_and_forced_custom_refuses(monkeypatch, caplog):
    monkeypatch.setattr(kernels_module, "cpu_features", lambda: {"sse2", "sse4_2", "fma", "f16c"})
    monkeypatch.setattr(kernels_module, "load_ops", lambda: pytest.fail("custom ops loaded on a CPU without AVX2"))

    with caplog.at_level(logging.WARNING, logger="worker.kernels.selection"):
        choice = select_kernels("auto")

    assert choice.kernels.name == "paddle"
    (record,) = caplog.records
    assert "lacks avx2" in record.getMessage()
    with pytest.raises(CustomOpsUnavailable, match="lacks avx2"):  # forced custom refuses rather than falls back
        select_kernels("custom")


# ---------------------------------------------------------------------------- a corrupt cache


def seeded_extension_dir(tmp_path: Path) -> Path:
    """A PADDLE_EXTENSION_DIR of this test's own holding a build of the current sources: a copy of the
    shared cache's (under its lock), or built here."""
    from paddle.utils.cpp_extension import get_build_directory

    from worker.kernels.cpu_ops import BUILD_SCRIPT
    from worker.kernels.op_build import build_definition

    build = build_definition(BUILD_SCRIPT, "blockserve_custom_ops_build")
    name = f"{build.EXTENSION_NAME}_{build.source_hash()}"
    extension_dir = tmp_path / "extensions"
    shared = Path(get_build_directory()) / name
    if (shared / build.EXTENSION_NAME / f"{build.EXTENSION_NAME}.so").exists():
        with open(shared / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            shutil.copytree(shared, extension_dir / name)
    else:
        env = {**os.environ, "PADDLE_EXTENSION_DIR": str(extension_dir)}
        subprocess.run(
            [sys.executable, "-c", "from worker.kernels.cpu_ops import load_ops; load_ops()"],
            env=env,
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=600,
        )
    return extension_dir


# One op of the ops' kind: the build tests' source folder (the real ops take minutes to build on 2 cores).
ONE_OP = """
#include "paddle/extension.h"

std::vector<paddle::Tensor> Twice(const paddle::Tensor& x) { return {x * 2.0f}; }

PD_BUILD_OP(bs_twice).Inputs({"X"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(Twice));
"""


def test_a_corrupt_cached_build_is_rebuilt_once_and_then_loads(tmp_path):
    """load_ops on a cache whose library is corrupt ("file too short") rebuilds it once from the sources, and the
    rebuilt library loads and runs: on a folder of one op, in fresh processes (a process loads a library once)."""
    source_dir = tmp_path / "ops"
    source_dir.mkdir()
    (source_dir / "twice_op.cc").write_text(ONE_OP)
    env = {**os.environ, "PADDLE_EXTENSION_DIR": str(tmp_path / "extensions")}
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); import paddle; "
        "from worker.kernels.cpu_ops import load_ops; "
        f"print('twice:', load_ops({str(source_dir)!r}).bs_twice(paddle.to_tensor([1.5])).numpy().tolist())"
    )

    def load() -> str:
        done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    built = load()
    (library,) = (tmp_path / "extensions").glob("blockserve_ops_*/blockserve_ops/blockserve_ops.so")
    library.write_bytes(b"")
    rebuilt = load()

    assert "twice: [3.0]" in built and "rebuilding" not in built
    assert rebuilt.count("rebuilding them from the sources") == 1 and "twice: [3.0]" in rebuilt
    assert library.stat().st_size > 0


def test_a_corrupt_cached_build_that_cannot_be_rebuilt_serves_with_pure_paddle_and_says_so(tmp_path):
    extension_dir = seeded_extension_dir(tmp_path)
    (library,) = extension_dir.glob("blockserve_ops_*/blockserve_ops/blockserve_ops.so")
    library.write_bytes(b"")  # "file too short" at every start
    env = loopback_env(
        PADDLE_EXTENSION_DIR=str(extension_dir), BLOCKSERVE_NUM_KV_BLOCKS="16", BLOCKSERVE_KERNELS="auto"
    )
    processes = [start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log")]
    peer = ApiPeer(env["BLOCKSERVE_SCHEDULER_ADDR"])
    try:
        # and nothing compiles either
        processes.append(start(["-m", "service.launch.cli", "worker"], {**env, "CC": "false", "CXX": "false"},
                               tmp_path / "worker.log"))  # fmt: skip
        peer.wait_until(lambda: peer.status(timeout_s=30).ready, 600)
        (info,) = metric_samples(env["BLOCKSERVE_METRICS_PORT"], "blockserve_settings_info")
        log = (tmp_path / "worker.log").read_text()

        assert info.labels["worker_kernels"] == "paddle"
        assert log.count("rebuilding them from the sources") == 1
        (warning,) = [line for line in log.splitlines() if "WARNING" in line and "worker.kernels" in line]
        assert "serving with pure Paddle" in warning and "failed" in warning
    finally:
        peer.close()
        stop_all(processes)


@pytest.mark.parametrize("rows, width, masked", [(1, 49152, [0]), (6, 1000, [1, 4, 5]), (3, 37, [0, 1, 2])])
def test_mask_rows_forbids_what_the_bits_forbid_as_the_paddle_path_does(custom, rows, width, masked):
    from worker.sample.token_mask import TokenMask, allowed_tokens

    rng = np.random.default_rng(width)
    logits = rng.standard_normal((rows, width), dtype=np.float32)
    words = (width + 31) // 32
    bitmask = rng.integers(-(2**31), 2**31, size=(len(masked), words), dtype=np.int64).astype(np.int32)
    bitmask[0, : words // 2] = 0  # a run of forbidden words, and one of words that allow all
    bitmask[-1, words // 2 :] = -1
    mask = TokenMask(np.array(masked, dtype=np.int64), bitmask)

    ours = custom.mask_rows(tensor(logits), mask).numpy()
    np.testing.assert_array_equal(ours, PaddleKernels().mask_rows(tensor(logits), mask).numpy())
    expected = logits.copy()
    expected[masked] = np.where(allowed_tokens(bitmask, width), logits[masked], -np.inf)
    np.testing.assert_array_equal(ours, expected)
    with pytest.raises(Exception):
        custom.mask_rows(tensor(logits), TokenMask(np.array([rows], dtype=np.int64), bitmask[:1]))


def eight_bit_tensor(rows: np.ndarray, kv_cache_dtype: str) -> paddle.Tensor:
    """8-bit rows (encode_rows' uint8 bytes) as a cache tensor of the kv cache dtype's Paddle dtype."""
    return tensor(rows).view(KV_ROW_FORMATS[kv_cache_dtype].paddle_dtype)


def eight_bit_rows(cache: paddle.Tensor, in_groups: bool = False, kind: str = "key") -> np.ndarray:
    """An 8-bit cache's rows, [num_blocks, block_size, kv_heads, head_dim + 2] (an int8 cache in groups: its bytes
    as rows, kv_rows.rows_of_groups)."""
    rows = cache.view("uint8").numpy()
    return rows_of_groups(rows, kind) if in_groups else rows


def vnni_int8_query(query: paddle.Tensor, head_dim: int) -> paddle.Tensor:
    """The query [tokens, heads, head_dim] as vpdpbusd multiplies it with an int8 cache's codes: its scaled rows
    quantized to int8 (int8_query_rows), unscaled again."""
    scale = np.float32(1 / np.sqrt(head_dim))
    scaled = query.numpy().reshape(-1, head_dim) * scale
    return tensor((int8_query_rows(scaled) / scale).reshape(query.shape))


def bf16_dot_query(query: paddle.Tensor, head_dim: int) -> paddle.Tensor:
    """The query [tokens, heads, head_dim] as vdpbf16ps multiplies it with a bf16 or fp8 cache: its scaled rows
    rounded to bf16, unscaled again."""
    scale = np.float32(1 / np.sqrt(head_dim))
    return tensor(bf16_rounded(query.numpy() * scale) / scale)


def assert_within_bf16_dot_bound(output, expected, weighted_magnitude, slack=1e-5):
    """vdpbf16ps' attention (the query rounded to bf16 in `expected` already): each probability is rounded to bf16
    too (relative error <= 2^-8) before it multiplies its value, so the output is off by at most 2^-8 of the
    probability-weighted |values| (weighted_magnitude: the attention over them), and `slack`."""
    bound = 2.0**-8 * weighted_magnitude + 1e-4 * np.abs(expected) + slack
    assert np.all(np.abs(output - expected) <= bound), np.max(np.abs(output - expected) / bound)


def dot_fp8_decoded(rows: np.ndarray) -> np.ndarray:
    """fp8 e4m3 rows decoded as vdpbf16ps reads them (attention_bf16_dot.h: DotCache<Fp8E4M3>): a subnormal code
    (exponent 0) decodes to a bf16 denormal, which it reads as zero."""
    rows = np.ascontiguousarray(rows).view(np.uint8).copy()
    codes = rows[..., :-2]
    codes[(codes & 0x78) == 0] &= 0x80
    return decode_rows(rows, "fp8_e4m3")


def assert_within_int8_weights_bound(
    output, expected, query, decoded_keys, value_rows, inputs, block_size, window=None, softcap=None
):
    """An int8 cache's attention on AVX512-VNNI within the bound of its values' weights rounded to 8 bits
    (int8_weights_error_bound) of the float attention over the decoded rows; decoded_keys a cache tensor,
    value_rows the value cache's rows [..., head_dim + 2]."""
    num_heads = query.shape[1]
    head_dim = query.shape[-1]
    num_kv_heads = value_rows.shape[-2]
    bound = int8_weights_error_bound(
        query.numpy().reshape(len(output), num_heads, head_dim),
        decoded_keys.numpy().reshape(-1, num_kv_heads, head_dim),
        value_rows.reshape(-1, num_kv_heads, head_dim + 2),
        inputs,
        block_size,
        1 / np.sqrt(head_dim),
        window,
        softcap,
    ).reshape(output.shape)
    error = np.abs(output - expected)
    assert (error <= bound + 1e-4 * np.abs(expected) + 1e-5).all(), (error - bound).max()


@pytest.mark.parametrize("kv_cache_dtype", EIGHT_BIT)
@pytest.mark.parametrize("step", DECODE_AND_MIXED_STEPS)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (8, 2, 32, 5), (10, 2, 80, 32)]
)
def test_an_8bit_cache_holds_the_reference_encoding_of_each_row_and_attention_reads_its_decoded_rows(
    custom, num_heads, num_kv_heads, head_dim, block_size, step, kv_cache_dtype
):
    """The op writes each new key (rotated) and value row as kv_rows.encode_rows encodes the row a float32 cache
    gets, bit for bit, and touches no other row; the attention equals the float32 attention over the decoded rows,
    for an int8 cache with AVX512-VNNI of the query rows quantized to int8 as vpdpbusd multiplies them, and within
    the bound of the values' weights rounded to 8 bits (int8_weights_error_bound). With AVX512-VNNI an int8 cache
    of blocks of 16 slots or more is in groups (kv_rows.rows_in_groups): the rows are placed there, and read back
    from there."""
    rng = np.random.default_rng(head_dim + 2)
    num_blocks = 2 * (-(-320 // block_size)) * 8 + 1
    config = attention_config(num_heads, num_kv_heads, head_dim, MAX_POSITIONS)
    rotary = RotaryEmbedding(config.rope, head_dim, MAX_POSITIONS)
    inputs = step(rng, block_size, num_blocks)
    before = encode_rows(
        rng.standard_normal((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32), kv_cache_dtype
    )
    qkv = rng.standard_normal((len(inputs.positions), (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)
    attention = custom.attention(config, block_size, rotary)
    metadata = attention.prepare(inputs)
    in_groups = kv_cache_dtype == "int8" and int8_cache_in_groups(custom.isa, block_size, head_dim)
    kinds = ("key", "value")
    placed = [rows_in_groups(rows, kind) if in_groups else rows for rows, kind in zip(before, kinds)]
    caches = [eight_bit_tensor(placed[0], kv_cache_dtype), eight_bit_tensor(placed[1], kv_cache_dtype)]
    float_caches = [tensor(decode_rows(before[0], kv_cache_dtype)), tensor(decode_rows(before[1], kv_cache_dtype))]

    output = attention.attend_qkv(tensor(qkv), *caches, metadata).numpy()

    query = write_float_caches(custom, qkv, metadata, rotary, float_caches, num_heads, num_kv_heads)
    written = inputs.slot_mapping
    unwritten = np.setdiff1d(np.arange(num_blocks * block_size), written)
    after = [eight_bit_rows(cache, in_groups, kind) for cache, kind in zip(caches, kinds)]
    for rows, float_cache, old in zip(after, float_caches, before):
        rows = rows.reshape(-1, num_kv_heads, head_dim + 2)
        np.testing.assert_array_equal(rows[unwritten], old.reshape(rows.shape)[unwritten])
        float_rows = float_cache.numpy().reshape(-1, num_kv_heads, head_dim)[written]
        np.testing.assert_array_equal(rows[written], encode_rows(float_rows, kv_cache_dtype))
    vnni_int8 = kv_cache_dtype == "int8" and custom.isa.bf16 and custom.isa.vnni
    dot_fp8 = kv_cache_dtype == "fp8_e4m3" and custom.isa.bf16 and head_dim % 32 == 0
    decoded = [tensor(dot_fp8_decoded(rows) if dot_fp8 else decode_rows(rows, kv_cache_dtype)) for rows in after]
    if vnni_int8:
        query = vnni_int8_query(query, head_dim)
    if dot_fp8:
        query = bf16_dot_query(query, head_dim)
    backend = PagedAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
    batch = backend.prepare(inputs)
    expected = backend.attend(query, *decoded, batch).numpy()
    if vnni_int8:  # the weights of the values rounded to 8 bits as well: within their bound
        assert_within_int8_weights_bound(output, expected, query, decoded[0], after[1], inputs, block_size)
    elif dot_fp8:  # the values' weights rounded to bf16 as well
        assert_within_bf16_dot_bound(
            output, expected, backend.attend(query, decoded[0], decoded[1].abs(), batch).numpy()
        )
    else:
        np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("step", [mixed_step, short_decode_step])
def test_an_fp8_cache_of_rows_orders_of_magnitude_apart_keeps_the_bf16_dots_bound(custom, step):
    """fp8 on vdpbf16ps: its codes decode to 2^-120 times their values, and the query rows and the values' weights
    carry 2^64 so that no product that counts is a denormal (read as zero), nor a weight too large for bf16
    (attention_bf16_dot.h: DotCache<Fp8E4M3>). Rows whose magnitudes lie ten orders apart (1e-6 to 1e4) and queries
    four orders apart stay within the bf16 dot's bound of the attention over the rows as it reads them. A product of a
    weight and a value under 2^-126 (2^-70 of the output's units, after the 2^56 the sums carry) is flushed: the only
    absolute slack is 320 keys' worth of those (2^-61.7); a product that counts flushed to zero, or a weight gone to
    infinity, breaks it."""
    if not custom.isa.bf16:
        pytest.skip("fp8 is read by vdpbf16ps only with AVX512-BF16; elsewhere its codes are widened to fp32")
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    rng = np.random.default_rng(41)
    num_blocks = 2 * (-(-320 // block_size)) * 8 + 1
    config = attention_config(num_heads, num_kv_heads, head_dim, MAX_POSITIONS)
    rotary = RotaryEmbedding(config.rope, head_dim, MAX_POSITIONS)
    inputs = step(rng, block_size, num_blocks)
    shape = (2, num_blocks, block_size, num_kv_heads)
    magnitudes = np.float32(10.0) ** rng.uniform(-6, 4, shape + (1,)).astype(np.float32)
    rows = encode_rows(rng.standard_normal(shape + (head_dim,), dtype=np.float32) * magnitudes, "fp8_e4m3")
    qkv = rng.standard_normal((len(inputs.positions), (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)
    qkv *= np.float32(10.0) ** rng.uniform(-2, 2, (len(inputs.positions), 1)).astype(np.float32)
    attention = custom.attention(config, block_size, rotary)
    metadata = attention.prepare(inputs)
    caches = [eight_bit_tensor(rows[0], "fp8_e4m3"), eight_bit_tensor(rows[1], "fp8_e4m3")]
    output = attention.attend_qkv(tensor(qkv), *caches, metadata).numpy()

    float_caches = [tensor(decode_rows(rows[0], "fp8_e4m3")), tensor(decode_rows(rows[1], "fp8_e4m3"))]
    query = bf16_dot_query(
        write_float_caches(custom, qkv, metadata, rotary, float_caches, num_heads, num_kv_heads), head_dim
    )
    decoded = [tensor(dot_fp8_decoded(eight_bit_rows(cache))) for cache in caches]
    backend = PagedAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
    batch = backend.prepare(inputs)
    expected = backend.attend(query, *decoded, batch).numpy()
    weighted_magnitude = backend.attend(query, decoded[0], decoded[1].abs(), batch).numpy()
    assert_within_bf16_dot_bound(output, expected, weighted_magnitude, slack=2.0**-61)


WINDOWS_AND_CAPS = [(1, None), (7, None), (64, None), (None, 30.0), (7, 2.0), (64, 50.0)]
WINDOWED_GEOMETRY = (8, 2, 32, 16)  # num_heads, num_kv_heads, head_dim, block_size


def windowed_layer(window, softcap):
    """The windows-and-caps tests' layer (WINDOWED_GEOMETRY): its config, rotary table and LayerAttention, and the
    caches' block count."""
    num_heads, num_kv_heads, head_dim, block_size = WINDOWED_GEOMETRY
    config = dataclasses.replace(
        attention_config(num_heads, num_kv_heads, head_dim, MAX_POSITIONS),
        sliding_windows=() if window is None else (window,),
        attention_softcap=softcap,
    )
    rotary = RotaryEmbedding(config.rope, head_dim, MAX_POSITIONS)
    layer = LayerAttention(rotary, sliding_window=window, softcap=softcap)
    return config, rotary, layer, 2 * (-(-320 // block_size)) * 8 + 1


@pytest.mark.parametrize("kv_cache_dtype", EIGHT_BIT)
@pytest.mark.parametrize("step", DECODE_AND_MIXED_STEPS)
@pytest.mark.parametrize("window, softcap", WINDOWS_AND_CAPS)
def test_an_8bit_cache_under_sliding_windows_and_soft_caps_reads_its_decoded_rows(
    custom, window, softcap, step, kv_cache_dtype
):
    """Windows and soft caps over an 8-bit cache: the float32 attention over the decoded rows. An int8 cache with
    AVX512-VNNI is in groups (its tiles' spans begin at a multiple of 16 keys, and the keys of a first group before
    the tile's or a window's first are hidden), its query rows quantized and within the 8-bit weights' bound; an fp8
    cache with AVX512-BF16 is read by vdpbf16ps (its scores scaled before they are capped), within the bf16 dot's
    bound over its rows decoded with the subnormal codes at zero."""
    num_heads, num_kv_heads, head_dim, block_size = WINDOWED_GEOMETRY
    rng = np.random.default_rng(29 if window is None else window)
    config, rotary, layer, num_blocks = windowed_layer(window, softcap)
    inputs = step(rng, block_size, num_blocks)
    rows = encode_rows(
        rng.standard_normal((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32), kv_cache_dtype
    )
    qkv = 3 * rng.standard_normal((len(inputs.positions), (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)
    attention = custom.attention(config, block_size, rotary)
    metadata = attention.prepare(inputs)
    in_groups = kv_cache_dtype == "int8" and int8_cache_in_groups(custom.isa, block_size, head_dim)
    kinds = ("key", "value")
    caches = [eight_bit_tensor(rows_in_groups(r, k) if in_groups else r, kv_cache_dtype) for r, k in zip(rows, kinds)]
    output = attention.attend_qkv(tensor(qkv), *caches, metadata, layer).numpy()

    float_caches = [tensor(decode_rows(rows[0], kv_cache_dtype)), tensor(decode_rows(rows[1], kv_cache_dtype))]
    query = write_float_caches(custom, qkv, metadata, rotary, float_caches, num_heads, num_kv_heads)
    after = [eight_bit_rows(cache, in_groups, kind) for cache, kind in zip(caches, kinds)]
    vnni_int8 = kv_cache_dtype == "int8" and custom.isa.bf16 and custom.isa.vnni
    dot_fp8 = kv_cache_dtype == "fp8_e4m3" and custom.isa.bf16 and head_dim % 32 == 0
    decoded = [tensor(dot_fp8_decoded(r) if dot_fp8 else decode_rows(r, kv_cache_dtype)) for r in after]
    reference = PagedAttentionBackend(
        num_heads, num_kv_heads, head_dim, block_size, sliding_windows=config.sliding_windows
    )
    batch = reference.prepare(inputs)
    if vnni_int8:
        query = vnni_int8_query(query, head_dim)
    if dot_fp8:
        query = bf16_dot_query(query, head_dim)
    expected = reference.attend(query, *decoded, batch, layer).numpy()
    if vnni_int8:
        assert_within_int8_weights_bound(
            output, expected, query, decoded[0], after[1], inputs, block_size, window, softcap
        )
    elif dot_fp8:
        assert_within_bf16_dot_bound(
            output, expected, reference.attend(query, decoded[0], decoded[1].abs(), batch, layer).numpy()
        )
    else:  # fp32 sums whose terms reach 3-5 here (qkv x 3): an fp8 cache's sums in another order differed by 1.4e-5
        np.testing.assert_allclose(output, expected, rtol=1e-4, atol=4e-5)


def steps_over_16_and_8_slot_blocks(rng, shapes: list[tuple[int, int]], num_blocks: int):
    """The same requests ((cached, new) tokens each) over blocks of 16 slots and over blocks of 8, every token in the
    same slot (block b of 16 is blocks 2b and 2b + 1 of 8), their block ids scattered (odd ones of 16 only)."""
    free = [int(b) for b in rng.permutation(np.arange(1, num_blocks, 2))]
    over_16, over_8 = [], []
    for i, (num_cached, num_new) in enumerate(shapes):
        length = num_cached + num_new
        blocks = [free.pop() for _ in range(-(-length // 16))]
        halves = [half for block in blocks for half in (2 * block, 2 * block + 1)]
        for scheduled, ids in ((over_16, blocks), (over_8, halves)):
            state = RequestState(f"r{i}", list(range(length)), length, wire.SamplingParams(), ids, num_cached)
            scheduled.append((state, num_new))
    return build_step_inputs(over_16, 16, num_blocks), build_step_inputs(over_8, 8, 2 * num_blocks)


@pytest.mark.parametrize(
    "shapes",
    [[(300, 1)], [(1000, 1)], [(9, 1), (0, 40), (37, 7), (300, 1), (125, 6), (13, 3)]],
    ids=["one decode of 301 keys", "one decode of 1001 keys", "decodes and prefill chunks"],
)
def test_an_int8_cache_in_groups_attends_as_the_same_rows_kept_as_rows_bit_for_bit(custom, shapes):
    """With AVX512-VNNI an int8 cache in blocks of 16 slots is kept in groups, in blocks of 8 as rows: the same tokens
    in the same slots are written to the same rows and attended to the same output, bit for bit. One decode (fewer
    requests than threads) is split over the threads: its parts begin at multiples of 16 keys, so that a part over
    groups reads no key of the part before and scores the spans that it scores over rows."""
    if not int8_cache_in_groups(custom.isa, 16, 64):
        pytest.skip("without AVX512-VNNI an int8 cache keeps rows in blocks of every size")
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    rng = np.random.default_rng(len(shapes))
    num_blocks = 2 * (-(-1001 // 16)) * len(shapes) + 1
    over_16, over_8 = steps_over_16_and_8_slot_blocks(rng, shapes, num_blocks)
    rows = encode_rows(rng.standard_normal((2, num_blocks, 16, num_kv_heads, head_dim), dtype=np.float32), "int8")
    qkv = tensor(rng.standard_normal((len(over_16.positions), (num_heads + 2 * num_kv_heads) * head_dim), np.float32))
    config = attention_config(num_heads, num_kv_heads, head_dim, MAX_POSITIONS)
    rotary = RotaryEmbedding(config.rope, head_dim, MAX_POSITIONS)
    kinds = ("key", "value")
    outputs, written = [], []
    for block_size, inputs in ((16, over_16), (8, over_8)):
        in_groups = int8_cache_in_groups(custom.isa, block_size, head_dim)
        assert in_groups == (block_size == 16)
        laid_out = [
            rows_in_groups(r, k) if in_groups else r.reshape(2 * num_blocks, 8, *r.shape[2:])
            for r, k in zip(rows, kinds)
        ]
        caches = [eight_bit_tensor(r, "int8") for r in laid_out]
        attention = custom.attention(config, block_size, rotary)
        outputs.append(attention.attend_qkv(qkv, *caches, attention.prepare(inputs)).numpy())
        written.append(
            [eight_bit_rows(c, in_groups, k).reshape(-1, num_kv_heads, head_dim + 2) for c, k in zip(caches, kinds)]
        )
    np.testing.assert_array_equal(outputs[0], outputs[1])
    for in_groups, in_rows in zip(*written):
        np.testing.assert_array_equal(in_groups, in_rows)


@pytest.mark.parametrize("step", DECODE_AND_MIXED_STEPS)
@pytest.mark.parametrize("window, softcap", WINDOWS_AND_CAPS)
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_sliding_windows_and_soft_caps_match_the_paddle_backend(custom, window, softcap, step, cache_dtype):
    """A layer's sliding window (each query sees the `window` keys up to its own) and its scores' soft cap: prefill
    chunks whose first queries' windows begin inside their first key span, decodes whose contexts are shorter and
    longer than the window, split over the threads within the window. float32 caches exactly as the Paddle backend;
    bf16 caches within the bf16 dot's bound (test_a_bfloat16_cache_holds_the_rounded_keys...)."""
    num_heads, num_kv_heads, head_dim, block_size = WINDOWED_GEOMETRY
    rng = np.random.default_rng(17 if window is None else window)
    config, rotary, layer, num_blocks = windowed_layer(window, softcap)
    inputs = step(rng, block_size, num_blocks)
    cache = bf16_rounded(rng.standard_normal((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32))
    qkv = 3 * rng.standard_normal((len(inputs.positions), (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)
    attention = custom.attention(config, block_size, rotary)
    assert isinstance(attention, CustomPagedAttention), "windows and soft caps are the custom kernels' own"
    metadata = attention.prepare(inputs)
    caches = [tensor(cache[0]).astype(cache_dtype), tensor(cache[1]).astype(cache_dtype)]
    output = attention.attend_qkv(tensor(qkv), *caches, metadata, layer).numpy()

    float_caches = [tensor(cache[0]), tensor(cache[1])]
    query = write_float_caches(custom, qkv, metadata, rotary, float_caches, num_heads, num_kv_heads)
    widened = [c.astype("float32") for c in caches]
    reference = PagedAttentionBackend(
        num_heads, num_kv_heads, head_dim, block_size, sliding_windows=config.sliding_windows
    )
    batch = reference.prepare(inputs)
    dot = cache_dtype == "bfloat16" and custom.isa.bf16
    if dot:  # vdpbf16ps multiplies the scaled query rounded to bf16
        query = bf16_dot_query(query, head_dim)
    expected = reference.attend(query, *widened, batch, layer).numpy()
    if not dot:
        np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)
        return
    assert_within_bf16_dot_bound(
        output, expected, reference.attend(query, widened[0], widened[1].abs(), batch, layer).numpy()
    )
