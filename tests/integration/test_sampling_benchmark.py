"""benchmarks/bench_sampling.py runs (one batch, two kinds): its figures back the custom draw's notes."""

from __future__ import annotations

import sys

import pytest

from tests.support.processes import ROOT


@pytest.fixture
def bench_sampling(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_sampling

    monkeypatch.setattr(bench_sampling, "BATCHES", (3,))
    monkeypatch.setattr(bench_sampling, "VOCAB_SIZE", 1000)
    monkeypatch.setattr(bench_sampling, "KINDS", {k: bench_sampling.KINDS[k] for k in ("greedy", "top_p 0.9")})
    yield bench_sampling
    sys.modules.pop("bench_sampling", None)


def test_bench_sampling_times_both_sides_of_each_kind(bench_sampling, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_sampling.py", "--repeats", "2"])
    bench_sampling.main()

    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[next(i for i, line in enumerate(lines) if line.startswith("kind")) + 1 :]]
    assert [row[:-4] for row in rows] == [["greedy"], ["top_p", "0.9"]]
    for row in rows:
        assert int(row[-4]) == 3 and float(row[-3]) > 0 and float(row[-2]) > 0
