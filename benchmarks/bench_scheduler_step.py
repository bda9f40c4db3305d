"""The scheduler's per-step cost and the size of what crosses to the worker (pytest-benchmark).

Run: python -m pytest benchmarks/bench_scheduler_step.py

Compare the groups' figures as ratios from one run: unified vs legacy scheduling cost per step of 64 decodes, and
of 256; 256 running requests, one ending and one admitted each step, beside 100 or 10,000 waiting (that the cost
follows the requests scheduled, not the queue, tests/unit/test_scheduler_step_cost.py holds by counting the
waiting requests each step reads); a delta step vs one that re-sends every request. (tests/integration/
test_pytest_benchmarks.py runs each case once, untimed.)
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's service and tests
from service.contract import wire  # noqa: E402
from service.scheduler.split_table import SplitTableConfig  # noqa: E402
from tests.support.busy_scheduler import BusyServer, decoding_scheduler, full_state_step  # noqa: E402

ROUNDS = 300  # steps measured: far fewer than the 4096 tokens each request may generate


def measure_steps(benchmark, scheduler) -> wire.SchedulerOutput:
    """schedule() + update() of one decode step; the worker's tokens are built once, outside the timing."""
    sampled = [wire.SampledToken(request.request_id, 7) for request in scheduler.running]

    def one_step() -> wire.SchedulerOutput:
        step = scheduler.schedule(0.0)
        scheduler.update(step, wire.StepResult(step_id=step.step_id, sampled=sampled), 0.0)
        return step.output

    return benchmark.pedantic(one_step, rounds=ROUNDS, warmup_rounds=10)


@pytest.mark.benchmark(group="scheduler step, decodes only")
@pytest.mark.parametrize(("mode", "num_running"), [("unified", 64), ("split-table", 64), ("unified", 256)])
def test_one_step_of_scheduling(benchmark, mode, num_running):
    split_table = None if mode == "unified" else SplitTableConfig(kv_cache_ratio=0.75)
    scheduler = decoding_scheduler(split_table, num_running)
    output = measure_steps(benchmark, scheduler)
    assert len(output.running_requests) == num_running and output.new_requests == []
    assert output.num_scheduled_tokens == num_running


@pytest.mark.benchmark(group="scheduler step, 256 running, one admitted")
@pytest.mark.parametrize("num_waiting", [100, 10_000])
def test_step_cost_beside_a_waiting_queue(benchmark, num_waiting):
    server = BusyServer(num_running=256, num_waiting=num_waiting)
    output = benchmark.pedantic(lambda: server.step()[0], rounds=ROUNDS, warmup_rounds=10)
    assert len(output.running_requests) == 255 and len(output.new_requests) == 1
    assert len(server.scheduler.waiting) == num_waiting
    benchmark.extra_info["num_waiting"] = num_waiting


@pytest.mark.benchmark(group="wire, one decode step of 64 requests")
@pytest.mark.parametrize("shape", ["deltas", "full state"])
def test_encoding_a_step(benchmark, shape):
    scheduler = decoding_scheduler(None)
    step = scheduler.schedule(0.0).output
    message = step if shape == "deltas" else full_state_step(scheduler, step)
    frame = benchmark(lambda: wire.encode(message))
    assert wire.decode(frame) == message
    benchmark.extra_info["frame_bytes"] = len(frame)
