"""Drive the real scheduler with a model-free worker on a virtual clock.

A step takes `fixed + per_token * scheduled tokens + per_context_token * attended tokens`
seconds; the fake worker's next token is a deterministic function of the prefix. Reports what
an operator cares about: throughput, preemptions, recomputed tokens, block usage, TTFT, TPOT.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from service import wire
from service.scheduler.fake_worker import FakeWorker
from service.scheduler.legacy import LegacyConfig, build_scheduler
from service.scheduler.scheduler import RequestRejected, SchedulerConfig
from service.workload import TraceRequest


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step time of a small model on one accelerator (defaults: roughly a 1B model on one GPU)."""

    step_fixed_s: float = 0.004
    per_token_s: float = 0.00005
    per_context_token_s: float = 0.0000002

    def step_time(self, num_scheduled_tokens: int, num_context_tokens: int) -> float:
        return (
            self.step_fixed_s + self.per_token_s * num_scheduled_tokens + self.per_context_token_s * num_context_tokens
        )


@dataclass(frozen=True, slots=True)
class SimulationReport:
    num_requests: int
    num_finished: int
    num_rejected: int
    num_failed: int  # ended with an error (legacy: incomplete)
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    num_steps: int
    num_preemptions: int
    num_recomputed_tokens: int
    mean_kv_usage: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class _Timing:
    __slots__ = ("arrival", "first_token", "finish", "num_tokens", "failed")

    def __init__(self, arrival: float):
        self.arrival, self.first_token, self.finish, self.num_tokens, self.failed = arrival, None, None, 0, False


def simulate(
    trace: list[TraceRequest],
    config: SchedulerConfig,
    cost: CostModel = CostModel(),
    legacy: LegacyConfig | None = None,
) -> SimulationReport:
    """Replay `trace` through the unified scheduler (or the legacy one, given `legacy`)."""
    scheduler = build_scheduler(config, legacy)
    worker = FakeWorker(config.num_blocks, config.block_size)
    pending = sorted(trace, key=lambda r: r.arrival_time_s)
    timings: dict[str, _Timing] = {}
    now, next_arrival, rejected, steps, usage_time = 0.0, 0, 0, 0, 0.0
    while next_arrival < len(pending) or scheduler.requests:
        while next_arrival < len(pending) and pending[next_arrival].arrival_time_s <= now:
            request = pending[next_arrival]
            next_arrival += 1
            sampling = wire.SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
            try:
                scheduler.add_request(request.request_id, request.prompt_token_ids, sampling, request.arrival_time_s)
            except RequestRejected:
                rejected += 1
                continue
            timings[request.request_id] = _Timing(request.arrival_time_s)
        step = scheduler.schedule(now)
        for delta in scheduler.take_ended_deltas():
            timings[delta.request_id].finish, timings[delta.request_id].failed = now, True
        if step.is_empty:
            if next_arrival < len(pending):
                now = max(now, pending[next_arrival].arrival_time_s)
                continue
            raise RuntimeError("scheduler stalled with requests left")  # a scheduler bug, never expected
        result = worker.execute(step)
        scheduled_ids = [r.request_id for r in step.new_requests] + [r.request_id for r in step.running_requests]
        context = sum(worker.requests[request_id].num_computed_tokens for request_id in scheduled_ids)
        duration = cost.step_time(step.num_scheduled_tokens, context)
        usage_time += scheduler.pool.usage * duration
        now += duration
        steps += 1
        for delta in scheduler.update(result, now):
            timing = timings[delta.request_id]
            if delta.token_ids and timing.first_token is None:
                timing.first_token = now
            timing.num_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                timing.finish = now
                timing.failed = delta.error is not None
    return _report(trace, timings, rejected, now, steps, usage_time, scheduler)


def _report(trace, timings, rejected, now, steps, usage_time, scheduler) -> SimulationReport:
    done = [t for t in timings.values() if t.finish is not None and not t.failed]
    start = min((r.arrival_time_s for r in trace), default=0.0)
    duration = max(now - start, 1e-9)
    ttft = np.array([t.first_token - t.arrival for t in done]) if done else np.zeros(1)
    tpot = np.array([(t.finish - t.first_token) / (t.num_tokens - 1) for t in done if t.num_tokens > 1] or [0.0])
    return SimulationReport(
        num_requests=len(trace),
        num_finished=len(done),
        num_rejected=rejected,
        num_failed=sum(1 for t in timings.values() if t.failed),
        duration_s=duration,
        output_tokens_per_s=sum(t.num_tokens for t in done) / duration,
        requests_per_s=len(done) / duration,
        num_steps=steps,
        num_preemptions=scheduler.stats.num_preemptions,
        num_recomputed_tokens=scheduler.stats.num_recomputed_tokens,
        mean_kv_usage=usage_time / duration,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        tpot_p50_s=float(np.percentile(tpot, 50)),
        tpot_p99_s=float(np.percentile(tpot, 99)),
    )
