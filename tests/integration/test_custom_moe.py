"""The experts of a mixture of experts on the custom CPU op (bs_moe_experts: tokens grouped by expert through the
packed GEMM) against NumPy in float32, and against the loop over experts of the same packed layers (the pure-Paddle
path's) in every weight format, on every instruction-set path this CPU has; on odd shapes, with experts no token
chose."""

from __future__ import annotations

import functools

import numpy as np
import paddle
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tests.support.isa_kernels import ISA_CAPS, custom_kernels_on
from worker.layers.experts import PackedExperts, PaddleExperts, experts
from worker.layers.linear import fused_linear, linear
from worker.layers.precision import Precision
from worker.layers.weight_format import GgufBlocks, WeightFormat

# (hidden, intermediate, experts, top k): widths off the 16-column panel (an intermediate not a whole panel cannot
# fuse SiLU-and-multiply into the GEMM), and a whole-panel one that can; many experts, so that 37 tokens choose
# enough of them for the threads to take whole experts (at least 4 per thread: up to 11 threads), as few do not.
SHAPES = [(37, 24, 8, 2), (64, 48, 6, 3), (96, 32, 8, 2), (32, 16, 48, 4)]
GGUF_SHAPES = [(64, 64, 6, 3), (96, 32, 8, 2)]  # GGUF rows (of gate, up and down) are whole blocks of 32
# one decode, a few, more than a tile on several experts (AMX from 16 rows), and 64 or more on the experts of 6 (AMX
# on INT8 and GGUF panels dequantized to bf16, the SiLU-and-multiply fused where the intermediate is whole panels)
TOKENS = [1, 5, 37, 160]
PRECISIONS = {
    WeightFormat.F32: Precision("float32", "none", "test"),
    WeightFormat.BF16: Precision("bfloat16", "none", "test"),
    WeightFormat.INT8: Precision("float32", "int8", "test"),
    WeightFormat.Q8_0: Precision("float32", "gguf", "test"),
    WeightFormat.Q4_0: Precision("float32", "gguf", "test"),
    WeightFormat.Q4_1: Precision("float32", "gguf", "test"),
}


@pytest.fixture(scope="module", params=ISA_CAPS)
def custom(request):
    return custom_kernels_on(request.param)


def expert_weights(rng, hidden: int, intermediate: int, num_experts: int) -> list[list[np.ndarray]]:
    """Each expert's gate, up [intermediate, hidden] and down [hidden, intermediate] (Hugging Face's layout)."""
    scale = np.float32(hidden**-0.5)
    return [
        [rng.standard_normal(shape, dtype=np.float32) * scale for shape in [(intermediate, hidden)] * 2]
        + [rng.standard_normal((hidden, intermediate), dtype=np.float32) * np.float32(intermediate**-0.5)]
        for _ in range(num_experts)
    ]


def routing(rng, tokens: int, num_experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct experts per token, never the last expert (one no token chose), and weights that need not sum to 1."""
    ids = np.stack([rng.permutation(num_experts - 1)[:top_k] for _ in range(tokens)]).astype(np.int64)
    return ids, rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)


def numpy_experts(x, ids, weights, matrices) -> np.ndarray:
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for expert, weight in zip(ids[t], weights[t]):
            gate, up, down = (m.astype(np.float64) for m in matrices[expert])
            g, u = gate @ x[t], up @ x[t]
            out[t] += weight * (down @ (g / (1 + np.exp(-g)) * u))
    return out


@functools.cache  # quantizing to Q4 in Python takes seconds: once for every instruction set
def stored_experts(hidden: int, intermediate: int, num_experts: int, weight_format: WeightFormat) -> tuple[list, ...]:
    """(gates, ups, downs) as a checkpoint holds them: fp32 arrays, or a GGUF file's blocks."""
    rng = np.random.default_rng(hidden + intermediate + int(weight_format))
    matrices = expert_weights(rng, hidden, intermediate, num_experts)
    if weight_format.is_gguf_block:
        quant_type = GGMLQuantizationType(int(weight_format))
        matrices = [
            [GgufBlocks(weight_format, quantize(m, quant_type), m.shape[1]) for m in expert] for expert in matrices
        ]
    return tuple(map(list, zip(*matrices)))


@pytest.mark.parametrize("hidden, intermediate, num_experts, top_k", SHAPES)
def test_grouped_experts_match_numpy_in_float32(custom, hidden, intermediate, num_experts, top_k):
    rng = np.random.default_rng(hidden * intermediate)
    matrices = expert_weights(rng, hidden, intermediate, num_experts)
    layer = experts(custom, *map(list, zip(*matrices)), PRECISIONS[WeightFormat.F32])
    assert isinstance(layer, PackedExperts)

    for tokens in TOKENS:
        x = rng.standard_normal((tokens, hidden), dtype=np.float32)
        ids, weights = routing(rng, tokens, num_experts, top_k)
        got = layer(paddle.to_tensor(x), paddle.to_tensor(ids), paddle.to_tensor(weights)).numpy()
        np.testing.assert_allclose(got, numpy_experts(x, ids, weights, matrices), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weight_format", list(PRECISIONS), ids=lambda f: f.name)
def test_grouped_experts_match_the_loop_over_experts_of_the_same_packed_layers(custom, weight_format):
    """Each expert's tokens meet the same micro-kernel in both (as many rows), so only the order of the sums
    and SiLU-and-multiply (fused into the GEMM or not) differ."""
    precision = PRECISIONS[weight_format]
    for hidden, intermediate, num_experts, top_k in GGUF_SHAPES if weight_format.is_gguf_block else SHAPES:
        rng = np.random.default_rng(hidden * intermediate)
        gates, ups, downs = stored_experts(hidden, intermediate, num_experts, weight_format)
        grouped = experts(custom, gates, ups, downs, precision)
        assert (grouped.gate_up_format, grouped.down_format) == (weight_format, weight_format)
        loop = PaddleExperts(
            tuple(fused_linear(custom, [gate, up], [None, None], precision) for gate, up in zip(gates, ups)),
            tuple(linear(custom, down, None, precision) for down in downs),
        )
        for tokens in TOKENS:
            x = paddle.to_tensor(rng.standard_normal((tokens, hidden), dtype=np.float32))
            ids, weights = map(paddle.to_tensor, routing(rng, tokens, num_experts, top_k))
            expected = loop(x, ids, weights, custom.silu_and_mul).numpy()
            np.testing.assert_allclose(grouped(x, ids, weights).numpy(), expected, rtol=1e-4, atol=1e-5)


def test_an_expert_id_outside_the_experts_is_refused(custom):
    rng = np.random.default_rng(0)
    matrices = expert_weights(rng, 37, 24, 4)
    layer = experts(custom, *map(list, zip(*matrices)), PRECISIONS[WeightFormat.F32])
    x = paddle.to_tensor(rng.standard_normal((2, 37), dtype=np.float32))

    with pytest.raises(Exception, match="expert id 4 outside"):
        layer(x, paddle.to_tensor(np.array([[0, 4], [1, 2]], np.int64)), paddle.ones([2, 2], "float32"))
