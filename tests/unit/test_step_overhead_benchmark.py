"""The scheduler's per-step cost and the size of what crosses to the worker (pytest-benchmark).

Compare the groups' figures as ratios from one run (`pytest tests/unit/test_step_overhead_benchmark.py`):
unified vs legacy scheduling cost per step; a delta step vs one that re-sends every request.
"""

import pytest

from service import wire
from service.scheduler.legacy import LegacyConfig, build_scheduler
from service.scheduler.outputs import new_request_message
from service.scheduler.scheduler import SchedulerConfig

NUM_REQUESTS = 64
PROMPT_LEN = 512
ROUNDS = 300  # steps measured: far fewer than the 4096 tokens each request may generate


def decoding_scheduler(legacy: LegacyConfig | None):
    """64 requests past their prefill, decoding one token a step, never finishing."""
    # Room for all 64 beside the admission reserve (output counted up to 4096 tokens each).
    config = SchedulerConfig(
        num_blocks=32_768, block_size=16, max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=65_536, max_model_len=8192
    )
    scheduler = build_scheduler(config, legacy)
    for index in range(NUM_REQUESTS):
        sampling = wire.SamplingParams(max_tokens=4096, ignore_eos=True)
        scheduler.add_request(f"r{index}", list(range(index, index + PROMPT_LEN)), sampling, 0.0)
    step = scheduler.schedule(0.0)
    scheduler.update(sampled_result(step), 0.0)
    return scheduler


def sampled_result(step: wire.SchedulerOutput) -> wire.StepResult:
    ids = [r.request_id for r in step.new_requests] + [r.request_id for r in step.running_requests]
    return wire.StepResult(step_id=step.step_id, sampled=[wire.SampledToken(request_id, 7) for request_id in ids])


@pytest.mark.benchmark(group="scheduler step, 64 decodes")
@pytest.mark.parametrize("mode", ["unified", "legacy"])
def test_one_step_of_scheduling(benchmark, mode):
    scheduler = decoding_scheduler(None if mode == "unified" else LegacyConfig(kv_cache_ratio=0.75))

    def one_step() -> wire.SchedulerOutput:
        step = scheduler.schedule(0.0)
        scheduler.update(sampled_result(step), 0.0)
        return step

    step = benchmark.pedantic(one_step, rounds=ROUNDS, warmup_rounds=10)
    assert len(step.running_requests) == NUM_REQUESTS and step.new_requests == []
    assert step.num_scheduled_tokens == NUM_REQUESTS


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
    step = scheduler.schedule(0.0)
    message = step if shape == "deltas" else full_state_step(scheduler, step)
    frame = benchmark(lambda: wire.encode(message))
    assert wire.decode(frame) == message
    full_size = len(wire.encode(full_state_step(scheduler, step)))
    if shape == "deltas":
        assert len(frame) * 50 < full_size, (len(frame), full_size)
    benchmark.extra_info["frame_bytes"] = len(frame)
