"""A bf16 cache's prefill attention on AMX tiles (custom_ops/cpu/attention_amx.h: the scores and the values of a
one-head tile of several queries by tdpbf16ps) against the Paddle backend, on the shapes its tiles cut unevenly:
query tiles of 1..5 heads' rows that are not a multiple of 16 (a pass is an upper and a lower tile of up to 16 rows),
spans of keys not a multiple of 32, causal diagonals inside and across key spans, sliding windows and soft caps;
and on the vdpbf16ps kernels (AVX512-BF16 without AMX), which the same shapes hold to the same bound."""

from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from service.contract import wire
from tests.integration.test_custom_ops import write_float_caches
from tests.support.isa_kernels import custom_kernels_on
from tests.support.numerics import attention_config, bf16_rounded
from worker.attention.backend import LayerAttention
from worker.attention.reference import PagedAttentionBackend
from worker.inputs.step_inputs import RequestState, build_step_inputs
from worker.layers.rotary import RotaryEmbedding

MAX_POSITIONS = 1024
BLOCK_SIZE = 5  # a block's slots are never a tile's rows: every key is gathered


@pytest.fixture(scope="module", params=["avx512+bf16+vnni", "all"])
def custom(request):
    """The kernels whose bf16 prefill scores by vdpbf16ps (AVX512-BF16, no AMX) and those on AMX tiles ("all",
    where this CPU has AMX and Linux grants its tiles; skipped elsewhere)."""
    kernels = custom_kernels_on(request.param)
    if not kernels.isa.bf16:
        pytest.skip("this CPU has no AVX512-BF16")
    return kernels


def tensor(array: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(np.ascontiguousarray(array))


def prefill_step(num_blocks: int):
    """Prefill chunks (cached tokens, new tokens): a fresh prompt of 45 (its diagonal in the first key span, query
    tiles of 16, 16 and 13), a chunk of 37 after 200 cached (its queries inside the second span, a tile of 5), a chunk
    of 40 after 300 (across the boundary of the third span at 256..384: its first tile's rows see one more span than
    its last's), and a chunk of 3 after 61; block ids scattered over the cache."""
    shapes = [(0, 45), (200, 37), (300, 40), (61, 3)]
    free = [int(b) for b in np.random.default_rng(5).permutation(np.arange(1, num_blocks, 2))]
    states = []
    for i, (num_cached, num_new) in enumerate(shapes):
        length = num_cached + num_new
        blocks = [free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        states.append(RequestState(f"r{i}", list(range(length)), length, wire.SamplingParams(), blocks, num_cached))
    return build_step_inputs([(s, n) for s, (_, n) in zip(states, shapes)], BLOCK_SIZE, num_blocks)


def attend(kernels, config, layer, qkv, cache, inputs):
    """The step's attention over a bf16 copy of `cache` (the op writes the step's keys and values into it): the
    output, the step's metadata and the bf16 caches."""
    attention = kernels.attention(config, BLOCK_SIZE, layer.rotary)
    metadata = attention.prepare(inputs)
    caches = [tensor(cache[0]).astype("bfloat16"), tensor(cache[1]).astype("bfloat16")]
    return attention.attend_qkv(tensor(qkv), *caches, metadata, layer).numpy(), metadata, caches


# (num_heads, num_kv_heads, head_dim): rows per kv head of a 16-query tile 48 (a pass of 32, one of 16), 80
# (32, 32, 16), 16, 64 and 32; of the 5-query tile 15, 25 (16 + 9), 5, 20 and 10.
SHAPES = [(9, 3, 64), (5, 1, 32), (4, 4, 128), (8, 2, 32), (2, 1, 256)]
WINDOWS_AND_CAPS = [(None, None), (50, None), (None, 30.0), (7, 2.0), (200, 50.0)]


@pytest.mark.parametrize("window, softcap", WINDOWS_AND_CAPS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
def test_bf16_prefill_attention_matches_the_paddle_backend_within_the_bf16_dot_bound(
    custom, num_heads, num_kv_heads, head_dim, window, softcap
):
    """The scaled query is rounded to bf16 for the scores, each probability before it multiplies its value:
    the output is off by at most 2^-8 of the probability-weighted |values| (the bound of
    test_custom_ops.py's test_a_bfloat16_cache_holds_the_rounded_keys...), on tiles or not."""
    rng = np.random.default_rng(head_dim * num_heads + (window or 0))
    num_blocks = 2 * (-(-340 // BLOCK_SIZE)) * 4 + 1
    config = dataclasses.replace(
        attention_config(num_heads, num_kv_heads, head_dim, MAX_POSITIONS),
        sliding_windows=() if window is None else (window,),
        attention_softcap=softcap,
    )
    layer = LayerAttention(
        RotaryEmbedding(config.rope, head_dim, MAX_POSITIONS), sliding_window=window, softcap=softcap
    )
    inputs = prefill_step(num_blocks)
    cache = bf16_rounded(rng.standard_normal((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), dtype=np.float32))
    qkv = 3 * rng.standard_normal((len(inputs.positions), (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)

    output, metadata, caches = attend(custom, config, layer, qkv, cache, inputs)

    float_caches = [tensor(cache[0]), tensor(cache[1])]
    query = write_float_caches(custom, qkv, metadata, layer.rotary, float_caches, num_heads, num_kv_heads)
    widened = [c.astype("float32") for c in caches]
    scale = np.float32(1 / np.sqrt(head_dim))
    query = tensor(bf16_rounded(query.numpy() * scale) / scale)
    reference = PagedAttentionBackend(
        num_heads, num_kv_heads, head_dim, BLOCK_SIZE, sliding_windows=config.sliding_windows
    )
    batch = reference.prepare(inputs)
    expected = reference.attend(query, *widened, batch, layer).numpy()
    weighted_magnitude = reference.attend(query, widened[0], widened[1].abs(), batch, layer).numpy()
    bound = 2.0**-8 * weighted_magnitude + 1e-4 * np.abs(expected) + 1e-5
    assert np.all(np.abs(output - expected) <= bound), np.max(np.abs(output - expected) / bound)


def test_a_cpu_with_amx_takes_the_tiles_for_a_bf16_prefill():
    """tdpbf16ps sums its products in another order than vdpbf16ps: where the kernels have AMX, a bf16 prefill's
    output differs in its last bits from the AVX512-BF16 kernels' (equal everywhere: the tiles were not used),
    and by no more than the two paths' bounds allow."""
    amx, dot = custom_kernels_on("all"), custom_kernels_on("avx512+bf16+vnni")
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    rng = np.random.default_rng(11)
    num_blocks = 2 * (-(-340 // BLOCK_SIZE)) * 4 + 1
    config = attention_config(num_heads, num_kv_heads, head_dim, MAX_POSITIONS)
    inputs = prefill_step(num_blocks)
    cache = bf16_rounded(rng.standard_normal((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), dtype=np.float32))
    qkv = rng.standard_normal((len(inputs.positions), (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)
    layer = LayerAttention(RotaryEmbedding(config.rope, head_dim, MAX_POSITIONS))

    on_tiles, _, _ = attend(amx, config, layer, qkv, cache, inputs)
    by_vectors, _, _ = attend(dot, config, layer, qkv, cache, inputs)

    assert not np.array_equal(on_tiles, by_vectors)
    np.testing.assert_allclose(on_tiles, by_vectors, rtol=0, atol=2.0**-7 * np.abs(cache[1]).max())
