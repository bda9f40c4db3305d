"""The scheduler's per-step cost and the size of what crosses to the worker (pytest-benchmark).

Compare the groups' figures as ratios from one run (`pytest tests/unit/test_step_overhead_benchmark.py`):
unified vs legacy scheduling cost per step; 256 decodes beside 100 or 10,000 waiting requests
(the cost must follow the requests scheduled, not the queue); a delta step vs one that re-sends
every request.
"""

import pytest

from service import wire
from service.scheduler.legacy import LegacyConfig, build_scheduler
from service.scheduler.outputs import new_request_message
from service.scheduler.scheduler import ScheduledStep, SchedulerConfig

PROMPT_LEN = 512
ROUNDS = 300  # steps measured: far fewer than the 4096 tokens each request may generate


def decoding_scheduler(legacy: LegacyConfig | None, num_running: int = 64, num_waiting: int = 0):
    """`num_running` requests past their prefill, decoding one token a step, never finishing;
    `num_waiting` more queued behind them (`max_num_seqs` is reached: they stay queued)."""
    # Room for all of them beside the admission reserve (output counted up to 4096 tokens each).
    config = SchedulerConfig(
        num_blocks=512 * num_running,
        block_size=16,
        max_num_seqs=num_running,
        max_num_batched_tokens=PROMPT_LEN * num_running,
        max_model_len=8192,
    )
    scheduler = build_scheduler(config, legacy)
    sampling = wire.SamplingParams(max_tokens=4096, ignore_eos=True)
    for index in range(num_running):
        scheduler.add_request(f"r{index}", list(range(index, index + PROMPT_LEN)), sampling, 0.0)
    step = scheduler.schedule(0.0)
    scheduler.update(step, sampled_result(step), 0.0)
    for index in range(num_waiting):
        scheduler.add_request(f"w{index}", list(range(index, index + PROMPT_LEN)), sampling, 0.0)
    return scheduler


def sampled_result(step: ScheduledStep) -> wire.StepResult:
    output = step.output
    ids = [r.request_id for r in output.new_requests] + [r.request_id for r in output.running_requests]
    return wire.StepResult(step_id=output.step_id, sampled=[wire.SampledToken(request_id, 7) for request_id in ids])


def measure_steps(benchmark, scheduler) -> wire.SchedulerOutput:
    """schedule() + update() of one decode step; the worker's tokens are built once, outside the timing."""
    sampled = [wire.SampledToken(request.request_id, 7) for request in scheduler.running]

    def one_step() -> wire.SchedulerOutput:
        step = scheduler.schedule(0.0)
        scheduler.update(step, wire.StepResult(step_id=step.step_id, sampled=sampled), 0.0)
        return step.output

    return benchmark.pedantic(one_step, rounds=ROUNDS, warmup_rounds=10)


@pytest.mark.benchmark(group="scheduler step, 64 decodes")
@pytest.mark.parametrize("mode", ["unified", "legacy"])
def test_one_step_of_scheduling(benchmark, mode):
    scheduler = decoding_scheduler(None if mode == "unified" else LegacyConfig(kv_cache_ratio=0.75))
    output = measure_steps(benchmark, scheduler)
    assert len(output.running_requests) == 64 and output.new_requests == []
    assert output.num_scheduled_tokens == 64


@pytest.mark.benchmark(group="scheduler step, 256 decodes")
@pytest.mark.parametrize("num_waiting", [100, 10_000])
def test_step_cost_follows_the_scheduled_requests_not_the_queue(benchmark, num_waiting):
    scheduler = decoding_scheduler(None, num_running=256, num_waiting=num_waiting)
    output = measure_steps(benchmark, scheduler)
    assert len(output.running_requests) == 256 and output.new_requests == []
    assert len(scheduler.waiting) == num_waiting
    benchmark.extra_info["num_waiting"] = num_waiting


def full_state_step(scheduler, step: wire.SchedulerOutput) -> wire.SchedulerOutput:
    """The same step as if every request were re-sent whole (what the proposal's v1 did).

    `step` already advanced each request's computed count by its one scheduled token.
    """
    resent = []
    for request in scheduler.running:
        request.num_computed_tokens -= 1
        resent.append(new_request_message(request, 1))
        request.num_computed_tokens += 1
    return wire.SchedulerOutput(step_id=step.step_id, new_requests=resent)


@pytest.mark.benchmark(group="wire, one decode step of 64 requests")
@pytest.mark.parametrize("shape", ["deltas", "full state"])
def test_encoding_a_step(benchmark, shape):
    scheduler = decoding_scheduler(None)
    step = scheduler.schedule(0.0).output
    message = step if shape == "deltas" else full_state_step(scheduler, step)
    frame = benchmark(lambda: wire.encode(message))
    assert wire.decode(frame) == message
    full_size = len(wire.encode(full_state_step(scheduler, step)))
    if shape == "deltas":
        assert len(frame) * 50 < full_size, (len(frame), full_size)
    benchmark.extra_info["frame_bytes"] = len(frame)
