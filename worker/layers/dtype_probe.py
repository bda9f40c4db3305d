"""BLOCKSERVE_DTYPE=auto on the custom CPU kernels, chosen by measurement on the CPU the worker runs on.

The name of an instruction says little about its speed: on an AMD Zen 4, bf16 weights through AVX512-BF16 made
a decode step 1.7x faster than float32; on an Intel Emerald Rapids the same code measured no faster (both as issue 50
reports them, measured in earlier sessions). So the
worker times its model's own linear layers (one decoder layer's q|k|v, o, gate|up and down, at a decode step's
rows and a prompt chunk's) with bfloat16 and with float32 weights, the two taking turns, and keeps the faster.
Both keep the accuracy thresholds (docs/worker.md). The result is cached in Paddle's extension folder, beside the
op build, keyed by what decides it (CPU model, instruction sets used, threads, the layer shapes and the op build),
so that only the first start on a kind of machine pays for it (a fraction of a second for SmolLM2).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from worker.kernels.protocol import Kernels
from worker.layers.linear import linear
from worker.layers.measurement_cache import default_cache_path, machine_key, read_cache, write_cache
from worker.layers.precision import Precision
from worker.models.config import ModelConfig

log = logging.getLogger(__name__)

CANDIDATES = ("bfloat16", "float32")  # the dtypes the custom CPU kernels serve, both within the accuracy thresholds
PROBE_ROWS = (16, 256)  # a decode step of 16 sequences; a prompt chunk
ROUNDS = 5  # each dtype timed this many times, taking turns; the median counts

# (dtype, rows, (in_features, out_features)) -> seconds of one call
TimeLinear = Callable[[str, int, tuple[int, int]], float]


@dataclass(frozen=True)
class DtypeMeasurement:
    seconds: dict[str, float]  # dtype -> one decoder layer's linear layers at every probed row count (median)
    chosen: str
    cached: bool  # read from the cache, not measured now

    @property
    def reason(self) -> str:
        others = ", ".join(
            f"{self.seconds[d] / self.seconds[self.chosen]:.2f}x the time in {d}"
            for d in self.seconds
            if d != self.chosen
        )
        how = "as measured on this CPU before" if self.cached else "measured on this CPU at start-up"
        return f"auto: {self.chosen}, the faster for this model's linear layers ({others}; {how})"


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's q|k|v, o, gate|up and down."""
    attention_width = config.num_heads * config.head_dim
    qkv_width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    return [
        (config.hidden_size, qkv_width),
        (attention_width, config.hidden_size),
        (config.hidden_size, 2 * config.intermediate_size),
        (config.intermediate_size, config.hidden_size),
    ]


def choose(seconds: dict[str, float]) -> str:
    """The faster dtype; never one that measured slower than another."""
    return min(CANDIDATES, key=lambda dtype: (seconds[dtype], CANDIDATES.index(dtype)))


def measure(time_linear: TimeLinear, shapes: list[tuple[int, int]], rounds: int = ROUNDS) -> dict[str, float]:
    """Per dtype, the median over `rounds` of one pass over every shape and row count; the dtypes take turns
    (in alternating order), so that a machine that slows down or speeds up meanwhile favours neither."""
    passes: dict[str, list[float]] = {dtype: [] for dtype in CANDIDATES}
    for round_index in range(rounds):
        order = CANDIDATES if round_index % 2 == 0 else CANDIDATES[::-1]
        for dtype in order:
            passes[dtype].append(sum(time_linear(dtype, rows, shape) for shape in shapes for rows in PROBE_ROWS))
    return {dtype: statistics.median(times) for dtype, times in passes.items()}


def measured_dtype(
    kernels: Kernels,
    config: ModelConfig,
    cache_path: Path | None = None,
    time_linear: TimeLinear | None = None,
) -> DtypeMeasurement:
    """The dtype `auto` serves `config` in on these custom kernels, from the cache or measured now (and cached)."""
    shapes = layer_shapes(config)
    cache_path = cache_path or default_cache_path()
    key = machine_key(kernels, shapes)
    cached = read_cache(cache_path).get(key)
    if isinstance(cached, dict) and set(cached) == set(CANDIDATES):
        seconds = {dtype: float(cached[dtype]) for dtype in CANDIDATES}
        return DtypeMeasurement(seconds, choose(seconds), cached=True)
    seconds = measure(time_linear or LinearTimer(kernels), shapes)
    write_cache(cache_path, key, seconds)
    return DtypeMeasurement(seconds, choose(seconds), cached=False)


class LinearTimer:
    """Seconds of one call of a custom linear layer of a shape, in a dtype's weight format, on random values.
    `variant` names what differs between the timed layers: here the dtype (gemm_route.py's: the GEMM's path)."""

    CALLS = 3  # per timing: the fastest counts (the first may find cold caches)

    def __init__(self, kernels: Kernels):
        self.kernels = kernels
        self._layers: dict[tuple[str, tuple[int, int]], object] = {}
        self._inputs: dict[tuple[int, int], paddle.Tensor] = {}
        self._random = np.random.default_rng(0)

    def __call__(self, variant: str, rows: int, shape: tuple[int, int]) -> float:
        if (variant, shape) not in self._layers:
            in_features, out_features = shape
            weight = self._random.standard_normal((out_features, in_features), dtype=np.float32) * 0.02
            self._layers[variant, shape] = self.layer(variant, weight)
        layer = self._layers[variant, shape]
        x = self._input(rows, shape[0])
        best = float("inf")
        for _ in range(self.CALLS):
            start = time.perf_counter()
            layer(x)
            best = min(best, time.perf_counter() - start)
        return best

    def layer(self, dtype: str, weight: np.ndarray):
        """The layer timed for `dtype`, of an [out_features, in_features] weight."""
        return linear(self.kernels, weight, None, Precision(dtype, "none", "dtype probe"))

    def _input(self, rows: int, in_features: int) -> paddle.Tensor:
        if (rows, in_features) not in self._inputs:
            values = self._random.standard_normal((rows, in_features), dtype=np.float32)
            self._inputs[rows, in_features] = paddle.to_tensor(values)
        return self._inputs[rows, in_features]
