"""benchmarks/bench_worker.py runs (one short case): the figures the README and closing notes quote come
from it, so it must not rot; its ISA cap reaches the worker."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from service import wire
from tests.support.processes import ROOT


@pytest.fixture
def bench_worker(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_worker

    monkeypatch.setattr(bench_worker, "DECODE_BATCHES", (1, 2))
    monkeypatch.setattr(bench_worker, "PREFILLS", ((1, 20),))
    yield bench_worker
    sys.modules.pop("bench_worker", None)


@pytest.mark.parametrize("op_by_op", [False, True])
def test_bench_worker_times_each_case_on_the_capped_instruction_set(bench_worker, op_by_op):
    probe = bench_worker.ReadProbe()
    run = bench_worker.run_precision("custom:bfloat16:none:avx2", steps=2, op_by_op=op_by_op, probe=probe)

    assert run.described["kernels_isa"] == "avx2" and run.described["dtype"] == "bfloat16"
    assert [case[:2] for case in run.cases] == [("decode B=1", 1), ("decode B=2", 2), ("prefill 1x20", 20)]
    # The read bandwidth the B=1 step is held against: one read before each of its timed steps, no others.
    assert len(run.read_bandwidths) == 2 and all(bandwidth > 0 for bandwidth in run.read_bandwidths)
    for _, _, seconds, parts in run.cases:
        assert seconds > 0 and parts["sampling"] > 0
        # Fused, the stack's own stage clock times its matmuls and attention, as the timers do op by op.
        assert parts["attention"] > 0 and parts["linear matmuls"] > 0
        assert parts["attention"] + parts["linear matmuls"] + parts["sampling"] < seconds
    assert run.weight_bytes > 0


def test_bench_worker_requests_sample_as_asked(bench_worker):
    """--temperature/--top-p/--top-k reach every request, and a run with them times its draw."""
    top_p = wire.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=bench_worker.GREEDY.max_tokens)
    asked = bench_worker.Workload(SimpleNamespace(block_size=16), top_p).new_requests(3, 5, room=2)
    default = bench_worker.Workload(SimpleNamespace(block_size=16)).new_requests(2, 5, room=2)
    assert [request.sampling for request in asked] == [top_p] * 3
    assert [request.sampling for request in default] == [bench_worker.GREEDY] * 2

    run = bench_worker.run_precision(
        "custom:float32:none", steps=2, op_by_op=False, probe=bench_worker.ReadProbe(), sampling=top_p
    )

    for _, _, seconds, parts in run.cases:
        assert 0 < parts["sampling"] < seconds
