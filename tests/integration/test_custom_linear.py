"""The linear layers: the packed custom GEMM against NumPy for every weight format on every instruction-set
path this CPU has, columns read back from packed weights, and fused projections equal to the separate ones
on both kernel paths."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tests.support.isa_kernels import ISA_CAPS, custom_kernels_on
from tests.support.numerics import bf16_rounded
from worker.kernels.reference import PaddleKernels
from worker.kernels.selection import select_kernels
from worker.layers.linear import PackedLinear, embedding_and_lm_head, fused_linear, linear
from worker.layers.precision import Precision
from worker.layers.weight_format import GgufBlocks, WeightFormat, quantize_int8

# (in_features, out_features): not multiples of the 16-column panel, the register tile or a bf16 pair / int8
# quad; depths past one K block (256) and widths of many panels; SmolLM2's fused q|k|v for scale.
SHAPES = [(37, 53), (5, 16), (300, 17), (1000, 100), (576, 960)]
GGUF_SHAPES = [(32, 53), (96, 17), (576, 200)]  # GGUF rows are whole blocks of 32
ROWS = [1, 3, 17, 64, 300]  # GEMV-like, partial tiles, a whole tile set, past one row block (96)
FLOAT32 = Precision("float32", "none", "test")
GGUF_TYPES = {
    WeightFormat.Q8_0: GGMLQuantizationType.Q8_0,
    WeightFormat.Q4_0: GGMLQuantizationType.Q4_0,
    WeightFormat.Q4_1: GGMLQuantizationType.Q4_1,
}


AMX_ROWS = [17, 64, 300]  # of ROWS, the ones AMX computes in every format (from 16 rows): a row past a tile, whole
# tiles, a partial one
# From this many rows (linear_gemm.cc's kAmxDequantMinRows) AMX multiplies INT8 and GGUF panels dequantized to bf16 by
# x rounded to bf16 (tdpbf16ps); below, tdpbsud's int32 sums of x quantized as for vpdpbusd.
AMX_DEQUANT_ROWS = 64
AMX_INT8_ROWS = [17, 48, AMX_DEQUANT_ROWS - 1]  # a row past a tile, a partial tile, the most below
# whole tiles, a row past, a partial tile; 1000 rows of 576 inputs are two blocks of rows (linear_amx_dequant.h's
# kBlockBytes, 1 MiB of x's bf16 rows)
AMX_DEQUANT_ROWS_TESTED = [AMX_DEQUANT_ROWS, AMX_DEQUANT_ROWS + 1, 96, 300, 1000]


@pytest.fixture(scope="module", params=ISA_CAPS)
def custom(request):
    return custom_kernels_on(request.param)


@pytest.fixture(scope="module")
def amx_and_dot_products():
    """The kernels with AMX's tiles, and the same CPU's without them (vdpbf16ps, vpdpbusd)."""
    return custom_kernels_on("all"), custom_kernels_on("avx512+bf16+vnni")


def random(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


def reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    expected = x.astype(np.float64) @ weight.astype(np.float64)
    return expected if bias is None else expected + bias


def int8_activations(x: np.ndarray) -> np.ndarray:
    """x as vpdpbusd multiplies it: quantized per row and group of 32 inputs to rint(x * 127 / max|x|), times
    max|x| / 127."""
    rows, width = x.shape
    padded = np.zeros((rows, -(-width // 32) * 32), np.float32)
    padded[:, :width] = x
    groups = padded.reshape(rows, -1, 32)
    max_abs = np.abs(groups).max(axis=2, keepdims=True)
    inverse = np.where(max_abs > 0, np.float32(127) / np.where(max_abs > 0, max_abs, 1), 0).astype(np.float32)
    quantized = np.rint(groups * inverse) * (max_abs / np.float32(127))
    return quantized.reshape(rows, -1)[:, :width]


def multiplied_operands(custom, rows: int, x: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x and an INT8 or GGUF weight's values as the kernel of `rows` rows multiplies them: rounded to bf16 on AMX from
    AMX_DEQUANT_ROWS, x quantized per 32 inputs on VNNI (and AMX's tdpbsud), else as they are."""
    if custom.isa.amx and rows >= AMX_DEQUANT_ROWS:
        return bf16_rounded(x), bf16_rounded(values)
    return (int8_activations(x) if custom.isa.vnni else x), values


def pack(
    custom, weight_format: WeightFormat, weight: np.ndarray, bias: np.ndarray | None = None
) -> tuple[PackedLinear, np.ndarray]:
    """The layer for an [in, out] weight in `weight_format`, and the fp32 values that format holds."""
    dtype = "bfloat16" if weight_format == WeightFormat.BF16 else "float32"
    quantization = "int8" if weight_format == WeightFormat.INT8 else "gguf" if weight_format.is_gguf_block else "none"
    precision = Precision(dtype, quantization, "test")
    if weight_format.is_gguf_block:
        blocks = GgufBlocks(weight_format, quantize(weight.T.copy(), GGUF_TYPES[weight_format]), weight.shape[0])
        return linear(custom, blocks, bias, precision), blocks.dequantized().T
    layer = linear(custom, np.ascontiguousarray(weight.T), bias, precision)
    if weight_format == WeightFormat.INT8:
        q, scales = quantize_int8(weight)
        return layer, q * scales
    return layer, bf16_rounded(weight) if weight_format == WeightFormat.BF16 else weight


@pytest.mark.parametrize("in_features, out_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_packed_float_linear_matches_numpy(custom, in_features, out_features, with_bias):
    rng = np.random.default_rng(in_features * out_features)
    weight = random(rng, in_features, out_features)
    bias = random(rng, out_features) if with_bias else None
    layer = linear(custom, np.ascontiguousarray(weight.T), bias, FLOAT32)
    assert isinstance(layer, PackedLinear) and layer.format == WeightFormat.F32

    for rows in ROWS:
        x = random(rng, rows, in_features)
        got = layer(paddle.to_tensor(x)).numpy()
        assert got.shape == (rows, out_features)
        np.testing.assert_allclose(got, reference(x, weight, bias), rtol=1e-4, atol=1e-4 * np.sqrt(in_features))


@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_bf16_weights_are_rounded_once_and_summed_in_float32(custom, in_features, out_features):
    """Weights rounded to bf16 at load; x is rounded too where vdpbf16ps multiplies, kept fp32 where the
    weights are widened."""
    rng = np.random.default_rng(in_features + out_features)
    weight, bias = random(rng, in_features, out_features), random(rng, out_features)
    layer, values = pack(custom, WeightFormat.BF16, weight, bias)

    for rows in ROWS:
        x = random(rng, rows, in_features)
        x_used = bf16_rounded(x) if custom.isa.bf16 else x
        got = layer(paddle.to_tensor(x)).numpy()
        np.testing.assert_allclose(got, reference(x_used, values, bias), rtol=1e-4, atol=1e-4 * np.sqrt(in_features))


@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_int8_weights_with_a_scale_per_output_feature(custom, in_features, out_features):
    """VNNI also quantizes x per 32 inputs (AMX from AMX_DEQUANT_ROWS: x and the weights rounded to bf16); elsewhere
    the int8 weights are widened and x stays fp32."""
    rng = np.random.default_rng(3 * in_features + out_features)
    weight, bias = random(rng, in_features, out_features), random(rng, out_features)
    q, scales = quantize_int8(weight)
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    assert (np.abs(q * scales - weight) <= scales / 2 * 1.0001).all()
    layer, values = pack(custom, WeightFormat.INT8, weight, bias)

    for rows in ROWS:
        x = random(rng, rows, in_features)
        got = layer(paddle.to_tensor(x)).numpy()
        expected = reference(*multiplied_operands(custom, rows, x, values), bias)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.sqrt(in_features))


@pytest.mark.parametrize("weight_format", list(GGUF_TYPES), ids=lambda f: f.name)
@pytest.mark.parametrize("in_features, out_features", GGUF_SHAPES)
def test_gguf_blocks_multiply_as_the_values_they_stand_for(custom, weight_format, in_features, out_features):
    """On VNNI as llama.cpp multiplies them: x quantized per 32 inputs (a GGUF block) to int8; on AMX from
    AMX_DEQUANT_ROWS, the values and x rounded to bf16."""
    rng = np.random.default_rng(in_features * 7 + out_features)
    layer, values = pack(custom, weight_format, random(rng, in_features, out_features))
    file_bytes = out_features * in_features // 32 * {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[weight_format.name]
    assert layer.format == weight_format and layer.packed.numel() <= file_bytes + 16 * in_features  # one padded panel

    for rows in ROWS:
        x = random(rng, rows, in_features)
        got = layer(paddle.to_tensor(x)).numpy()
        expected = reference(*multiplied_operands(custom, rows, x, values), None)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.sqrt(in_features))


@pytest.mark.parametrize("weight_format", [WeightFormat.INT8, *GGUF_TYPES], ids=lambda f: f.name)
@pytest.mark.parametrize("in_features, out_features", [(37, 53), (96, 17), (300, 40), (576, 200)])
def test_amx_int8_tiles_equal_vpdpbusd_bit_for_bit(amx_and_dot_products, weight_format, in_features, out_features):
    """Below AMX_DEQUANT_ROWS, tdpbsud's int32 sums of a group are vpdpbusd's, scaled by the same fp32 operations in
    the same order."""
    if weight_format.is_gguf_block and in_features % 32:
        in_features += 32 - in_features % 32  # GGUF rows are whole blocks
    amx, dot_products = amx_and_dot_products
    rng = np.random.default_rng(in_features * 11 + out_features)
    weight, bias = random(rng, in_features, out_features), random(rng, out_features)
    on_tiles, _ = pack(amx, weight_format, weight, bias)
    on_vectors, _ = pack(dot_products, weight_format, weight, bias)

    for rows in AMX_INT8_ROWS:
        x = paddle.to_tensor(random(rng, rows, in_features))
        np.testing.assert_array_equal(on_tiles(x).numpy(), on_vectors(x).numpy())


@pytest.mark.parametrize("weight_format", [WeightFormat.INT8, *GGUF_TYPES], ids=lambda f: f.name)
@pytest.mark.parametrize("in_features, out_features", [(5, 33), (37, 53), (96, 17), (300, 40), (576, 200)])
def test_amx_dequantized_panels_sum_bf16_weights_and_x_in_float32(
    amx_and_dot_products, weight_format, in_features, out_features
):
    """From AMX_DEQUANT_ROWS rows the panels are dequantized to bf16 (d * q + offset in fp32, rounded once more) and
    summed with x rounded to bf16 by tdpbf16ps: within fp32 rounding of bf16(x) . bf16(values), which the int8 path
    (x quantized per 32 inputs) is not. Depths of words past the last whole tile (INT8: 5, 37, 300 inputs), one panel
    or two per tile (17, 33, 40 and 200 columns end on a tile of one panel), two blocks of rows (1000 x 576)."""
    if weight_format.is_gguf_block and in_features % 32:
        in_features += 32 - in_features % 32  # GGUF rows are whole blocks
    amx, dot_products = amx_and_dot_products
    rng = np.random.default_rng(in_features * 17 + out_features)
    weight, bias = random(rng, in_features, out_features), random(rng, out_features)
    on_tiles, values = pack(amx, weight_format, weight, bias)
    on_vectors, _ = pack(dot_products, weight_format, weight, bias)

    for rows in AMX_DEQUANT_ROWS_TESTED:
        x = random(rng, rows, in_features)
        got, int8_path = on_tiles(paddle.to_tensor(x)).numpy(), on_vectors(paddle.to_tensor(x)).numpy()
        x_used, values_used = multiplied_operands(amx, rows, x, values)
        exact = reference(x_used, values_used, bias)
        # fp32 sums of k + 1 terms, in any order: within (k + 1) * 2^-24 of the sum of their magnitudes
        bound = (in_features + 1) * 2.0**-24 * (np.abs(x_used) @ np.abs(values_used) + np.abs(bias)) + 1e-30
        assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)
        assert not np.all(np.abs(int8_path - exact) <= bound)  # the bound tells the two kernels apart


@pytest.mark.parametrize("in_features, out_features", [(5, 16), (37, 53), (64, 33), (300, 17), (1000, 100)])
def test_amx_bf16_tiles_sum_what_vdpbf16ps_sums_in_another_order(amx_and_dot_products, in_features, out_features):
    """Depths of words past the last whole tile (5, 37, 300, 1000 inputs), of whole tiles only (64), one panel or
    two per tile: tdpbf16ps rounds its fp32 sums in its own order, so the two agree to fp32 rounding."""
    amx, dot_products = amx_and_dot_products
    rng = np.random.default_rng(in_features * 13 + out_features)
    weight, bias = random(rng, in_features, out_features), random(rng, out_features)
    on_tiles, values = pack(amx, WeightFormat.BF16, weight, bias)
    on_vectors, _ = pack(dot_products, WeightFormat.BF16, weight, bias)

    for rows in AMX_ROWS:
        x = random(rng, rows, in_features)
        got, expected = on_tiles(paddle.to_tensor(x)).numpy(), on_vectors(paddle.to_tensor(x)).numpy()
        exact = reference(bf16_rounded(x), values, bias)
        # fp32 sums of k + 1 terms, in any order: within (k + 1) * 2^-24 of the sum of their magnitudes
        bound = (in_features + 1) * 2.0**-24 * (np.abs(bf16_rounded(x)) @ np.abs(values) + np.abs(bias)) + 1e-30
        assert np.all(np.abs(got - exact) <= bound) and np.all(np.abs(expected - exact) <= bound)


@pytest.mark.parametrize("weight_format", list(WeightFormat), ids=lambda f: f.name)
def test_columns_read_back_from_a_packed_weight_are_its_values(custom, weight_format):
    rng = np.random.default_rng(int(weight_format))
    layer, values = pack(custom, weight_format, random(rng, 64, 41))
    ids = np.array([0, 40, 17, 17, 16], dtype=np.int64)

    columns = layer.columns(paddle.to_tensor(ids)).numpy()

    np.testing.assert_array_equal(columns, values[:, ids].T.astype(np.float32))


def test_packed_linear_rejects_an_input_of_the_wrong_width(custom):
    layer = linear(custom, np.ones((4, 8), np.float32), None, FLOAT32)
    with pytest.raises(OSError, match="bs_linear_pack"):  # how Paddle raises a PD_CHECK failure
        layer(paddle.ones([2, 9]))


@pytest.fixture(params=["custom", "paddle"])
def kernels(request):
    return PaddleKernels() if request.param == "paddle" else select_kernels("custom", isa_cap="avx2").kernels


def test_fused_projections_equal_the_separate_ones_with_a_bias_on_some(kernels):
    rng = np.random.default_rng(7)
    hf_weights = [random(rng, 24, 40), random(rng, 8, 40), random(rng, 8, 40)]  # [out, in] like q, k, v
    biases = [random(rng, 24), None, random(rng, 8)]
    x = random(rng, 5, 40)

    fused = fused_linear(kernels, hf_weights, biases, FLOAT32)(paddle.to_tensor(x)).numpy()

    separate = [reference(x, w.T, b) for w, b in zip(hf_weights, biases)]
    np.testing.assert_allclose(fused, np.concatenate(separate, axis=1), rtol=1e-4, atol=1e-4)


def test_fused_gguf_projections_keep_their_blocks_or_fall_back_to_the_values_when_types_differ():
    custom = select_kernels("custom", isa_cap="avx2").kernels
    rng = np.random.default_rng(9)
    weights = [random(rng, 48, 64), random(rng, 16, 64)]
    gguf = Precision("float32", "gguf", "test")
    same = [GgufBlocks(WeightFormat.Q4_1, quantize(w, GGMLQuantizationType.Q4_1), 64) for w in weights]
    mixed = [same[0], GgufBlocks(WeightFormat.Q8_0, quantize(weights[1], GGMLQuantizationType.Q8_0), 64)]
    x = random(rng, 3, 64)

    for blocks, expected_format in ((same, WeightFormat.Q4_1), (mixed, WeightFormat.F32)):
        layer = fused_linear(custom, blocks, [None, None], gguf)
        values = np.concatenate([b.dequantized() for b in blocks])
        assert layer.format == expected_format
        np.testing.assert_allclose(
            layer(paddle.to_tensor(x)).numpy(), reference(x, values.T, None), rtol=1e-4, atol=1e-4
        )


def test_embedding_and_lm_head_through_the_tied_table_or_their_own_weights(kernels):
    rng = np.random.default_rng(8)
    table, untied, hidden = random(rng, 50, 24), random(rng, 50, 24), random(rng, 3, 24)
    ids = paddle.to_tensor(np.array([3, 49, 0], dtype=np.int64))

    tied_embedding, tied_head = embedding_and_lm_head(kernels, table, None, FLOAT32)
    embedding, untied_head = embedding_and_lm_head(kernels, table, untied, FLOAT32)

    np.testing.assert_allclose(
        tied_head(paddle.to_tensor(hidden)).numpy(), reference(hidden, table.T, None), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(
        untied_head(paddle.to_tensor(hidden)).numpy(), reference(hidden, untied.T, None), rtol=1e-4, atol=1e-4
    )
    for lookup in (tied_embedding, embedding):
        np.testing.assert_array_equal(lookup(ids).numpy(), table[[3, 49, 0]])
    if kernels.name == "custom":  # the tied table is held once, as the packed lm_head
        assert [id(t) for t in tied_embedding.tensors()] == [id(t) for t in tied_head.tensors()]


def test_amx_gemms_of_other_tile_shapes_in_between_change_no_result(amx_and_dot_products):
    """A thread's AMX tiles stay configured from one tile to the next, are configured again only where the shapes
    differ (amx_tiles.h configure_tiles) and released after a thread's last tile: bf16 tiles of 32 and of 17 rows (a
    lower tile of one row), int8 tiles (32-byte rows of x), dequantized GGUF panels, and dot products in between give
    each GEMM the same bits as when it ran first. (A configuration kept from a GEMM of other tile shapes fails this.)"""
    amx, dot_products = amx_and_dot_products
    rng = np.random.default_rng(7)
    cases = []
    for weight_format, rows, in_features, out_features in [
        (WeightFormat.BF16, 17, 300, 53),
        (WeightFormat.INT8, 48, 96, 40),
        (WeightFormat.BF16, 300, 576, 200),
        (WeightFormat.Q4_0, 64, 96, 33),
        (WeightFormat.Q8_0, 20, 64, 17),
        (WeightFormat.BF16, 32, 37, 16),
    ]:
        layer, _ = pack(amx, weight_format, random(rng, in_features, out_features), random(rng, out_features))
        x = paddle.to_tensor(random(rng, rows, in_features))
        cases.append((layer, x, layer(x).numpy()))
    vector_layer, _ = pack(dot_products, WeightFormat.BF16, random(rng, 64, 32))
    for order in (cases[::-1], cases[1::2] + cases[::2]):
        for layer, x, first in order:
            vector_layer(paddle.to_tensor(random(rng, 3, 64)))
            np.testing.assert_array_equal(layer(x).numpy(), first)
