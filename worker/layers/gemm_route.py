"""From how many rows of x the GEMMs of bf16 weights run on oneDNN's matmul instead of blockserve's own kernels,
chosen by measurement on the CPU the worker runs on (issue 50: "where oneDNN measures faster for a shape, use it").

oneDNN is the library inside Paddle's wheel (custom_ops/cpu/linear_onednn.h: it reads the BF16 panels where they
are, and runs one part of the GEMM on each of the kernels' threads). On an Intel Xeon with AMX, oneDNN's matmul
multiplied prompt-sized GEMMs 1.3-2x faster than these kernels' AMX tiles (docs/worker.md; measured through PyTorch),
and these kernels were faster at decode sizes; on an AMD Zen 4 these kernels were the faster at every size. So the
worker times one decoder layer's q|k|v, o, gate|up and down both ways at each of ROUTE_ROWS rows, the two taking
turns, and routes from the fewest rows at which oneDNN measured faster there and at every larger count (none: never).
Cached beside the dtype measurement (layers/measurement_cache.py), keyed by what decides it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import paddle

from worker.kernels.cpu import CustomKernels
from worker.layers.dtype_probe import LinearTimer, layer_shapes
from worker.layers.linear import linear
from worker.layers.measurement_cache import default_cache_path, machine_key, read_cache, write_cache
from worker.layers.precision import Precision
from worker.models.config import ModelConfig

ROUTE_ROWS = (64, 128, 256, 512)  # a large decode batch up to a prompt chunk
PATHS = ("blockserve", "onednn")
ROUNDS = 5  # each path timed this many times per row count, taking turns; the median counts

# (path, rows, (in_features, out_features)) -> seconds of one call
TimeGemm = Callable[[str, int, tuple[int, int]], float]


@dataclass(frozen=True)
class GemmRoute:
    rows: int  # GEMMs of bf16 weights from this many rows on oneDNN's matmul; 0: never
    reason: str  # why, with the measured ratios


def onednn_version(kernels: CustomKernels) -> tuple[int, int, int]:
    """The oneDNN the custom ops were built with (zeros: none)."""
    parts = kernels.ops.bs_linear_onednn_version(paddle.zeros([1])).numpy()
    return int(parts[0]), int(parts[1]), int(parts[2])


def choose_rows(seconds: dict[str, dict[int, float]]) -> int:
    """The fewest probed rows from which oneDNN measured faster at that count and every larger one; 0 if none."""
    chosen = 0
    for rows in sorted(seconds["onednn"], reverse=True):
        if seconds["onednn"][rows] >= seconds["blockserve"][rows]:
            break
        chosen = rows
    return chosen


def measure(time_gemm: TimeGemm, shapes: list[tuple[int, int]], rounds: int = ROUNDS) -> dict[str, dict[int, float]]:
    """Per path and row count, the median over `rounds` of one pass over every shape; the paths take turns (in
    alternating order), so that a machine that slows down or speeds up meanwhile favours neither."""
    passes: dict[str, dict[int, list[float]]] = {path: {rows: [] for rows in ROUTE_ROWS} for path in PATHS}
    for round_index in range(rounds):
        order = PATHS if round_index % 2 == 0 else PATHS[::-1]
        for rows in ROUTE_ROWS:
            for path in order:
                passes[path][rows].append(sum(time_gemm(path, rows, shape) for shape in shapes))
    return {
        path: {rows: statistics.median(times) for rows, times in by_rows.items()} for path, by_rows in passes.items()
    }


def describe(rows: int, seconds: dict[str, dict[int, float]], cached: bool) -> str:
    ratios = ", ".join(
        f"{seconds['onednn'][r] / seconds['blockserve'][r]:.2f}x at {r}" for r in sorted(seconds["onednn"])
    )
    how = "as measured on this CPU before" if cached else "measured on this CPU at start-up"
    where = f"from {rows} rows on oneDNN's matmul" if rows else "on blockserve's kernels at every size"
    return f"GEMMs of bf16 weights {where} (oneDNN / blockserve time: {ratios}; {how})"


def cache_key(kernels: CustomKernels, shapes: list[tuple[int, int]]) -> str:
    return f"gemm route|{machine_key(kernels, shapes)}"


def measured_route(
    kernels: CustomKernels, config: ModelConfig, cache_path: Path | None = None, time_gemm: TimeGemm | None = None
) -> GemmRoute:
    """Where `config`'s bf16 GEMMs run on these kernels, from the cache or measured now (and cached)."""
    if not kernels.isa.bf16:
        return GemmRoute(0, "GEMMs of bf16 weights on blockserve's kernels (oneDNN's route needs AVX512-BF16)")
    if onednn_version(kernels) == (0, 0, 0):
        return GemmRoute(0, "GEMMs of bf16 weights on blockserve's kernels (the ops were built without oneDNN)")
    shapes = layer_shapes(config)
    cache_path = cache_path or default_cache_path()
    key = cache_key(kernels, shapes)
    cached = read_cache(cache_path).get(key)
    if isinstance(cached, dict) and set(cached) == set(PATHS):
        try:
            seconds = {path: {int(r): float(s) for r, s in cached[path].items()} for path in PATHS}
        except (AttributeError, TypeError, ValueError):
            seconds = None
        if seconds is not None and all(set(seconds[path]) == set(ROUTE_ROWS) for path in PATHS):
            rows = choose_rows(seconds)
            return GemmRoute(rows, describe(rows, seconds, cached=True))
    seconds = measure(time_gemm or GemmTimer(kernels), shapes)
    write_cache(cache_path, key, {path: {str(r): s for r, s in by_rows.items()} for path, by_rows in seconds.items()})
    rows = choose_rows(seconds)
    return GemmRoute(rows, describe(rows, seconds, cached=False))


def routed(kernels: CustomKernels, rows: int) -> CustomKernels:
    """`kernels` with GEMMs of bf16 weights from `rows` rows on oneDNN's matmul (0: never)."""
    return CustomKernels(kernels.ops, replace(kernels.isa, onednn_rows=rows), kernels.fuse_layers)


class GemmTimer(LinearTimer):
    """Seconds of one call of a bf16 linear layer of a shape, on blockserve's kernels or on oneDNN's matmul."""

    def __init__(self, kernels: CustomKernels):
        super().__init__(kernels)
        self.paths = {"blockserve": routed(kernels, 0), "onednn": routed(kernels, 1)}

    def layer(self, path: str, weight: np.ndarray):
        return linear(self.paths[path], weight, None, Precision("bfloat16", "none", "gemm route probe"))
