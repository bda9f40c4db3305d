"""The linear layers: the packed custom GEMM against NumPy on both instruction sets, and fused
projections equal to the separate ones on both kernel paths."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from gpu_worker.custom_ops import cpu_features
from gpu_worker.kernels import PaddleKernels, select_kernels
from gpu_worker.linear import PackedLinear, fused_linear, linear, lm_head

# (in_features, out_features): not multiples of the 16-column panel or of the register tile; depths past
# one K block (256) and widths of many panels; SmolLM2's fused q|k|v for scale.
SHAPES = [(37, 53), (5, 16), (300, 17), (1000, 100), (576, 960)]
ROWS = [1, 3, 17, 64, 300]  # GEMV-like, partial tiles, a whole tile set, past one row block (96)


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def custom(request):
    """The custom kernels on one instruction set: AVX2 forced, or AVX-512 where the CPU has it."""
    if request.param == "avx512" and "avx512f" not in cpu_features():
        pytest.skip("this CPU has no AVX-512F")
    kernels = select_kernels("custom", force_avx2=request.param == "avx2").kernels
    assert kernels.avx512 == (request.param == "avx512")
    return kernels


def random(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


def reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    expected = x.astype(np.float64) @ weight.astype(np.float64)
    return expected if bias is None else expected + bias


@pytest.mark.parametrize("in_features, out_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_packed_linear_matches_numpy(custom, in_features, out_features, with_bias):
    rng = np.random.default_rng(in_features * out_features)
    weight = random(rng, in_features, out_features)
    bias = random(rng, out_features) if with_bias else None
    layer = linear(custom, weight, bias)
    assert isinstance(layer, PackedLinear)

    for rows in ROWS:
        x = random(rng, rows, in_features)
        got = layer(paddle.to_tensor(x)).numpy()
        assert got.shape == (rows, out_features)
        np.testing.assert_allclose(got, reference(x, weight, bias), rtol=1e-4, atol=1e-4 * np.sqrt(in_features))


def test_packed_linear_rejects_an_input_of_the_wrong_width(custom):
    layer = linear(custom, np.ones((8, 4), np.float32), None)
    with pytest.raises(OSError, match="bs_linear_pack"):  # how Paddle raises a PD_CHECK failure
        layer(paddle.ones([2, 9]))


@pytest.fixture(params=["custom", "paddle"])
def kernels(request):
    return PaddleKernels() if request.param == "paddle" else select_kernels("custom", force_avx2=True).kernels


def test_fused_projections_equal_the_separate_ones_with_a_bias_on_some(kernels):
    rng = np.random.default_rng(7)
    hf_weights = [random(rng, 24, 40), random(rng, 8, 40), random(rng, 8, 40)]  # [out, in] like q, k, v
    biases = [random(rng, 24), None, random(rng, 8)]
    x = random(rng, 5, 40)

    fused = fused_linear(kernels, hf_weights, biases)(paddle.to_tensor(x)).numpy()

    separate = [reference(x, w.T, b) for w, b in zip(hf_weights, biases)]
    np.testing.assert_allclose(fused, np.concatenate(separate, axis=1), rtol=1e-4, atol=1e-4)


def test_lm_head_gives_logits_through_the_tied_embedding_or_its_own_weight(kernels):
    rng = np.random.default_rng(8)
    embedding, untied, hidden = random(rng, 50, 24), random(rng, 50, 24), random(rng, 3, 24)

    tied_logits = lm_head(kernels, None, paddle.to_tensor(embedding))(paddle.to_tensor(hidden)).numpy()
    untied_logits = lm_head(kernels, untied, paddle.to_tensor(embedding))(paddle.to_tensor(hidden)).numpy()

    np.testing.assert_allclose(tied_logits, reference(hidden, embedding.T, None), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(untied_logits, reference(hidden, untied.T, None), rtol=1e-4, atol=1e-4)
