"""BLOCKSERVE_DTYPE=auto by measurement (worker/layers/dtype_probe.py): the faster dtype is chosen, the dtypes
take turns, and the result is cached per machine kind, with a fake clock (the real one: test_worker_runner.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from worker.layers import measurement_cache
from worker.layers.dtype_probe import CANDIDATES, PROBE_ROWS, choose, layer_shapes, measure, measured_dtype
from worker.models.config import ModelConfig, RopeConfig

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    rope=RopeConfig(),
)
KERNELS = SimpleNamespace(ops=SimpleNamespace(), isa=SimpleNamespace(name="avx512+bf16+vnni"))


class FakeClock:
    """Seconds per call by dtype; records the calls."""

    def __init__(self, per_call: dict[str, float]):
        self.per_call = per_call
        self.calls: list[tuple[str, int, tuple[int, int]]] = []

    def __call__(self, dtype: str, rows: int, shape: tuple[int, int]) -> float:
        self.calls.append((dtype, rows, shape))
        return self.per_call[dtype] * rows


def test_layer_shapes_are_one_decoder_layers_projections():
    assert layer_shapes(CONFIG) == [(64, (4 + 2 * 2) * 16), (4 * 16, 64), (64, 2 * 160), (160, 64)]


@pytest.mark.parametrize("faster", CANDIDATES)
def test_the_faster_dtype_is_chosen_and_never_a_slower_one(faster):
    seconds = {dtype: 1.0 if dtype == faster else 1.01 for dtype in CANDIDATES}
    assert choose(seconds) == faster


def test_every_shape_and_row_count_is_timed_and_the_dtypes_take_turns_in_alternating_order():
    clock = FakeClock({"bfloat16": 1e-6, "float32": 2e-6})
    shapes = layer_shapes(CONFIG)

    seconds = measure(clock, shapes, rounds=4)

    per_pass = len(shapes) * len(PROBE_ROWS)
    firsts = [clock.calls[i * per_pass][0] for i in range(0, 2 * 4, 2)]  # the dtype that opens each round
    assert firsts == ["bfloat16", "float32", "bfloat16", "float32"]
    assert {(rows, shape) for _, rows, shape in clock.calls} == {(r, s) for r in PROBE_ROWS for s in shapes}
    assert seconds["float32"] == pytest.approx(2 * seconds["bfloat16"])


def test_the_median_round_counts_so_one_slow_round_changes_nothing():
    rounds = iter([1.0, 5.0, 1.0, 1.0, 1.0])  # bfloat16's second round is slow (the machine was busy)

    def clock(dtype: str, rows: int, shape: tuple[int, int]) -> float:
        if dtype == "bfloat16" and rows == PROBE_ROWS[0] and shape == layer_shapes(CONFIG)[0]:
            return next(rounds)
        return 0.0 if dtype == "bfloat16" else 1.5

    seconds = measure(clock, layer_shapes(CONFIG)[:1], rounds=5)
    assert seconds["bfloat16"] == 1.0 and choose(seconds) == "bfloat16"


def test_a_measurement_is_cached_per_cpu_and_measured_again_for_another(tmp_path: Path, monkeypatch):
    cache = tmp_path / "choices.json"
    clock = FakeClock({"bfloat16": 3e-6, "float32": 2e-6})
    monkeypatch.setattr(measurement_cache, "cpu_model_name", lambda: "Intel(R) Xeon(R) Processor")

    first = measured_dtype(KERNELS, CONFIG, cache, clock)
    assert first.chosen == "float32" and not first.cached and "measured on this CPU at start-up" in first.reason
    assert "1.50x the time in bfloat16" in first.reason
    calls = len(clock.calls)

    again = measured_dtype(KERNELS, CONFIG, cache, clock)
    assert again.chosen == "float32" and again.cached and len(clock.calls) == calls  # not measured again

    monkeypatch.setattr(measurement_cache, "cpu_model_name", lambda: "AMD EPYC 9R14")
    other = measured_dtype(KERNELS, CONFIG, cache, FakeClock({"bfloat16": 1e-6, "float32": 2e-6}))
    assert other.chosen == "bfloat16" and not other.cached
    assert len(json.loads(cache.read_text())) == 2  # both machines' results kept


def test_a_corrupt_cache_is_measured_over_and_an_unwritable_one_only_costs_a_measurement(tmp_path: Path):
    cache = tmp_path / "choices.json"
    cache.write_text("{not json")
    assert measured_dtype(KERNELS, CONFIG, cache, FakeClock({"bfloat16": 1e-6, "float32": 2e-6})).chosen == "bfloat16"
    assert json.loads(cache.read_text())  # rewritten whole

    unwritable = tmp_path / "a file" / "choices.json"
    (tmp_path / "a file").write_text("")  # its folder is a file: nothing can be written under it
    result = measured_dtype(KERNELS, CONFIG, unwritable, FakeClock({"bfloat16": 2e-6, "float32": 1e-6}))
    assert result.chosen == "float32" and not result.cached
