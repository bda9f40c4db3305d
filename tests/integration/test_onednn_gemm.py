"""GEMMs of bf16 weights on oneDNN's matmul (custom_ops/cpu/linear_onednn.h, the library inside Paddle's wheel): the
same products as NumPy's of the bf16-rounded operands on odd shapes, with and without bias; GEMMs it cannot take stay
on the kernels; the route is taken from its rows on, only with AVX512-BF16 allowed, and a cap without AMX keeps
oneDNN off AMX (seen in oneDNN's own log, ONEDNN_VERBOSE). Where the measurement sends them: test_gemm_route.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import paddle
import pytest

from tests.support.isa_kernels import custom_kernels_on
from tests.support.numerics import bf16_rounded
from worker.kernels.cpu import CustomKernels
from worker.kernels.cpu_isa import ONEDNN_ROWS_SHIFT
from worker.layers.gemm_route import onednn_version, routed
from worker.layers.linear import embedding_and_lm_head, linear
from worker.layers.precision import Precision

ROOT = Path(__file__).resolve().parents[2]
BF16 = Precision("bfloat16", "none", "test")
# (in_features, out_features): depths of one and many 16-row blocks, widths of one column, of a partial panel, of
# many panels; SmolLM2's q|k|v and down.
SHAPES = [(16, 1), (64, 17), (576, 960), (1536, 53)]
ROWS = [1, 3, 17, 130]


def paddle_ships_onednn() -> bool:
    sys.path.insert(0, str(ROOT / "custom_ops"))
    try:
        import build  # custom_ops/build.py

        return build.paddle_onednn_library() is not None
    finally:
        sys.path.pop(0)


@pytest.fixture(scope="module", params=["avx512+bf16+vnni", "all"])
def bf16_kernels(request) -> CustomKernels:
    """The kernels with AVX512-BF16 (with and without AMX, where the CPU has it) and oneDNN's route from 1 row."""
    kernels = custom_kernels_on(request.param)
    if not kernels.isa.bf16:
        pytest.skip("this CPU has no AVX512-BF16: oneDNN's route is for bf16 weights multiplied there")
    if not paddle_ships_onednn():
        pytest.skip("this Paddle wheel has no libdnnl.so.3")
    assert onednn_version(kernels)[0] == 3  # built against the wheel's oneDNN
    return routed(kernels, 1)


def reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    expected = x.astype(np.float64) @ weight.astype(np.float64)
    return expected if bias is None else expected + bias


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_onednn_bf16_gemm_multiplies_the_bf16_rounded_operands(bf16_kernels, in_features, out_features, with_bias):
    rng = np.random.default_rng(in_features + 7 * out_features + with_bias)
    weight = rng.standard_normal((in_features, out_features), dtype=np.float32)
    bias = rng.standard_normal(out_features, dtype=np.float32) if with_bias else None
    layer = linear(bf16_kernels, np.ascontiguousarray(weight.T), bias, BF16)
    ours = linear(routed(bf16_kernels, 0), np.ascontiguousarray(weight.T), bias, BF16)
    for rows in ROWS:
        x = rng.standard_normal((rows, in_features), dtype=np.float32)
        got = layer(paddle.to_tensor(x)).numpy()
        expected = reference(bf16_rounded(x), bf16_rounded(weight), bias)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.sqrt(in_features))
        # the kernels' own product of the same operands: fp32 sums in another order
        np.testing.assert_allclose(got, ours(paddle.to_tensor(x)).numpy(), rtol=1e-5, atol=1e-5 * np.sqrt(in_features))


@pytest.mark.parametrize("in_features", [8, 37, 300])
def test_onednn_bf16_route_leaves_depths_not_of_16_rows_to_the_kernels(bf16_kernels, in_features):
    """The panels are oneDNN's BA16a16b2a only for whole 16-row blocks: other depths stay on the kernels, correct."""
    rng = np.random.default_rng(in_features)
    weight = rng.standard_normal((in_features, 40), dtype=np.float32)
    layer = linear(bf16_kernels, np.ascontiguousarray(weight.T), None, BF16)
    x = rng.standard_normal((33, in_features), dtype=np.float32)
    expected = reference(bf16_rounded(x), bf16_rounded(weight), None)
    np.testing.assert_allclose(
        layer(paddle.to_tensor(x)).numpy(), expected, rtol=1e-4, atol=1e-4 * np.sqrt(in_features)
    )


def test_onednn_bf16_route_leaves_the_lm_head_to_the_kernels(bf16_kernels):
    """The lm_head's shape is not among those the worker's measurement times (layers/gemm_route.py)."""
    rng = np.random.default_rng(5)
    table, lm_head = (rng.standard_normal((100, 64), dtype=np.float32) for _ in range(2))
    _, tied = embedding_and_lm_head(bf16_kernels, table, None, BF16)
    _, separate = embedding_and_lm_head(bf16_kernels, table, lm_head, BF16)
    layer = linear(bf16_kernels, lm_head, None, BF16)
    assert layer.isa >> ONEDNN_ROWS_SHIFT == 1  # a layer's GEMMs routed from 1 row
    assert tied.isa >> ONEDNN_ROWS_SHIFT == 0 and separate.isa >> ONEDNN_ROWS_SHIFT == 0
    assert tied.isa == separate.isa == layer.isa & ((1 << ONEDNN_ROWS_SHIFT) - 1)


ROUTE_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    import numpy as np, paddle
    from worker.kernels.selection import select_kernels
    from worker.layers.gemm_route import routed
    from worker.layers.linear import embedding_and_lm_head, linear
    from worker.layers.precision import Precision

    libc = ctypes.CDLL(None)
    kernels = routed(select_kernels("custom", isa_cap=sys.argv[1]).kernels, 64)
    weight = np.random.default_rng(0).standard_normal((96, 64), dtype=np.float32)
    layer = linear(kernels, weight, None, Precision(sys.argv[2], "none", "test"))
    for rows in (63, 64, 200):
        layer(paddle.to_tensor(np.ones((rows, 64), np.float32)))
        sys.stdout.flush()
        libc.fflush(None)
        print(f"after {rows} rows", flush=True)
    """
)


def onednn_runs_by_rows(isa_cap: str, dtype: str = "bfloat16") -> dict[int, list[str]]:
    """oneDNN's matmul executions (ONEDNN_VERBOSE lines) after each GEMM of 63, 64 and 200 rows, routed from 64."""
    environment = {**os.environ, "ONEDNN_VERBOSE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", ROUTE_SCRIPT, isa_cap, dtype],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs: dict[int, list[str]] = {}
    current: list[str] = []
    for line in result.stdout.splitlines():
        if line.startswith("after "):
            runs[int(line.split()[1])] = current
            current = []
        elif "primitive,exec,cpu,matmul" in line:
            current.append(line)
    return runs


def test_onednn_bf16_route_takes_gemms_from_its_rows_and_keeps_a_cap_without_amx_off_amx():
    features_kernels = custom_kernels_on("avx512+bf16+vnni")
    if not features_kernels.isa.bf16:
        pytest.skip("this CPU has no AVX512-BF16: oneDNN's route is for bf16 weights multiplied there")
    if not paddle_ships_onednn():
        pytest.skip("this Paddle wheel has no libdnnl.so.3")
    runs = onednn_runs_by_rows("avx512+bf16+vnni")
    assert runs[63] == []  # below the route's rows: the kernels
    for rows in (64, 200):
        assert runs[rows], f"no oneDNN matmul ran for {rows} rows"
        assert all("brg_matmul" in line and "amx" not in line for line in runs[rows]), runs[rows]


def test_onednn_route_is_not_taken_without_avx512_bf16_or_for_float32_weights():
    custom_kernels_on("avx512")  # skips where the CPU has no AVX-512F
    assert all(lines == [] for lines in onednn_runs_by_rows("avx512").values())
    assert all(lines == [] for lines in onednn_runs_by_rows("avx512+bf16+vnni", "float32").values())
