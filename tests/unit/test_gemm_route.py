"""Where the GEMMs of bf16 weights run (worker/layers/gemm_route.py): on oneDNN's matmul from the fewest probed rows at
which it measured faster there and at every larger count, never where it measured slower; the two paths take turns;
the result is cached per machine kind. A fake clock here; the real route: test_onednn_gemm.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.unit.test_dtype_probe import CONFIG
from worker.layers import gemm_route, measurement_cache
from worker.layers.dtype_probe import layer_shapes
from worker.layers.gemm_route import PATHS, ROUTE_ROWS, choose_rows, measure, measured_route


def kernels(version=(3, 6, 2), bf16=True):
    """Kernels as measured_route reads them: their isa and the oneDNN the ops were built with."""
    ops = SimpleNamespace(bs_linear_onednn_version=lambda _: SimpleNamespace(numpy=lambda: np.array(version)))
    return SimpleNamespace(ops=ops, isa=SimpleNamespace(name="avx512+bf16+vnni", bf16=bf16))


class FakeClock:
    """Seconds per call: blockserve's 1 per row; oneDNN's by row count (per row), from `onednn`."""

    def __init__(self, onednn: dict[int, float]):
        self.onednn = onednn
        self.calls: list[tuple[str, int, tuple[int, int]]] = []

    def __call__(self, path: str, rows: int, shape: tuple[int, int]) -> float:
        self.calls.append((path, rows, shape))
        return rows * (1.0 if path == "blockserve" else self.onednn[rows]) * 1e-6


def seconds_with(onednn: dict[int, float]) -> dict[str, dict[int, float]]:
    return {"blockserve": dict.fromkeys(ROUTE_ROWS, 1.0), "onednn": onednn}


@pytest.mark.parametrize(
    "onednn, rows",
    [
        ({64: 1.2, 128: 1.1, 256: 0.9, 512: 0.7}, 256),  # faster from 256 rows
        ({64: 0.9, 128: 0.8, 256: 0.7, 512: 0.6}, 64),  # faster everywhere
        ({64: 0.9, 128: 1.1, 256: 0.9, 512: 0.8}, 256),  # faster at 64, slower at 128: from 256 only
        ({64: 0.9, 128: 0.9, 256: 0.9, 512: 1.05}, 0),  # slower at the most rows: never
        ({64: 1.1, 128: 1.1, 256: 1.0, 512: 1.0}, 0),  # as fast is not faster
    ],
)
def test_the_route_starts_where_onednn_is_faster_at_every_larger_count_and_never_where_it_is_slower(onednn, rows):
    assert choose_rows(seconds_with(onednn)) == rows


def test_every_shape_and_row_count_is_timed_and_the_paths_take_turns_in_alternating_order():
    clock = FakeClock({64: 2.0, 128: 1.0, 256: 0.5, 512: 0.5})
    shapes = layer_shapes(CONFIG)
    seconds = measure(clock, shapes, rounds=4)
    per_round = len(shapes) * len(ROUTE_ROWS) * len(PATHS)
    firsts = [clock.calls[i * per_round][0] for i in range(4)]
    assert firsts == ["blockserve", "onednn", "blockserve", "onednn"]
    assert {(path, rows, shape) for path, rows, shape in clock.calls} == {
        (p, r, s) for p in PATHS for r in ROUTE_ROWS for s in shapes
    }
    assert seconds["onednn"][64] == pytest.approx(2 * seconds["blockserve"][64])
    assert choose_rows(seconds) == 256


def test_a_route_is_cached_per_cpu_and_measured_again_for_another(tmp_path: Path, monkeypatch):
    cache = tmp_path / "choices.json"
    clock = FakeClock({64: 1.5, 128: 1.2, 256: 0.8, 512: 0.6})
    monkeypatch.setattr(measurement_cache, "cpu_model_name", lambda: "Intel(R) Xeon(R) Platinum 8580")

    first = measured_route(kernels(), CONFIG, cache, clock)
    assert first.rows == 256 and "measured on this CPU at start-up" in first.reason
    assert "from 256 rows on oneDNN's matmul" in first.reason and "0.60x at 512" in first.reason
    calls = len(clock.calls)

    again = measured_route(kernels(), CONFIG, cache, clock)
    assert again.rows == 256 and "as measured on this CPU before" in again.reason
    assert len(clock.calls) == calls  # not measured again

    monkeypatch.setattr(measurement_cache, "cpu_model_name", lambda: "AMD EPYC 9R14")
    other = measured_route(kernels(), CONFIG, cache, FakeClock({64: 1.5, 128: 1.2, 256: 1.1, 512: 1.1}))
    assert other.rows == 0 and "on blockserve's kernels at every size" in other.reason
    assert len(json.loads(cache.read_text())) == 2  # both machines' results kept


def test_a_corrupt_cache_entry_is_measured_over(tmp_path: Path, monkeypatch):
    cache = tmp_path / "choices.json"
    monkeypatch.setattr(measurement_cache, "cpu_model_name", lambda: "Intel(R) Xeon(R) Platinum 8580")
    key = gemm_route.cache_key(kernels(), layer_shapes(CONFIG))
    cache.write_text(json.dumps({key: {"blockserve": {"64": "fast"}, "onednn": 3}}))
    clock = FakeClock({64: 0.5, 128: 0.5, 256: 0.5, 512: 0.5})
    assert measured_route(kernels(), CONFIG, cache, clock).rows == 64 and clock.calls


@pytest.mark.parametrize(
    "fake, why", [(kernels(bf16=False), "needs AVX512-BF16"), (kernels(version=(0, 0, 0)), "built without oneDNN")]
)
def test_no_route_is_measured_without_avx512_bf16_or_without_onednn(tmp_path: Path, fake, why):
    clock = FakeClock(dict.fromkeys(ROUTE_ROWS, 0.1))
    route = measured_route(fake, CONFIG, tmp_path / "choices.json", clock)
    assert route.rows == 0 and why in route.reason and clock.calls == []
