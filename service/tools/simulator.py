"""Drive the real scheduler with a model-free worker on a virtual clock.

A step takes `fixed + per_token * scheduled tokens + per_context_token * attended tokens`
seconds; the fake worker's next token is a deterministic function of the prefix. Reports what
an operator cares about: throughput, preemptions, recomputed tokens, block usage, TTFT, TPOT.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass

import numpy as np

from service.contract import wire
from service.scheduler.engine import EngineLoop
from service.scheduler.request import FinishReason, Request
from service.scheduler.scheduler import RequestRejected, ScheduledStep, SchedulerConfig, build_scheduler
from service.scheduler.split_table import SplitTableConfig
from service.tools.fake_worker import FakeWorker
from service.tools.workload import TraceRequest


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
    num_failed: int  # ended with an error (split table: incomplete)
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
    high_priority_ttft_p50_s: float  # requests of priority below 0 (0 if none)
    high_priority_ttft_p99_s: float
    by_tenant: dict[str, dict[str, float]]  # tenant -> finished requests, output tok/s, TTFT p50 (s)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def simulate(
    trace: list[TraceRequest],
    config: SchedulerConfig,
    cost: CostModel = CostModel(),
    split_table: SplitTableConfig | None = None,
    overlapped: bool = False,
) -> SimulationReport:
    """Replay `trace` through the unified scheduler (or the split-table one, given `split_table`).

    `overlapped` drives it as the overlapped step loop does (the next step decided while one computes).
    """
    scheduler = build_scheduler(config, split_table)
    engine = EngineLoop(scheduler, overlapped)
    worker = FakeWorker(config.num_blocks, config.block_size)
    sent: deque[wire.SchedulerOutput] = deque()  # steps the worker has not computed yet, in order
    pending = sorted(trace, key=lambda r: r.arrival_time_s)
    finished: list[Request] = []

    def send(step: ScheduledStep) -> None:
        finished.extend(step.outcome.finished)
        sent.append(step.output)

    now, next_arrival, rejected, steps, usage_time = 0.0, 0, 0, 0, 0.0
    tenant_names = {request.tenant for request in trace}
    backlogged_tokens: Counter[str] = Counter()  # output tokens per tenant while every tenant had requests waiting
    while next_arrival < len(pending) or scheduler.requests or engine.in_flight:
        while next_arrival < len(pending) and pending[next_arrival].arrival_time_s <= now:
            request = pending[next_arrival]
            next_arrival += 1
            sampling = wire.SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
            try:
                scheduler.add_request(
                    request.request_id,
                    request.prompt_token_ids,
                    sampling,
                    request.arrival_time_s,
                    priority=request.priority,
                    tenant=request.tenant,
                    tenant_weight=request.tenant_weight,
                )
            except RequestRejected:
                rejected += 1
        engine.run(now, send)
        if not engine.in_flight:
            if next_arrival < len(pending):
                now = max(now, pending[next_arrival].arrival_time_s)
                continue
            raise RuntimeError("scheduler stalled with requests left")  # a scheduler bug, never expected
        step = sent.popleft()
        while step.is_empty:  # state to drop only: no time, no answer
            worker.execute(step)
            step = sent.popleft()
        result = worker.execute(step)
        tenants = scheduler.fair_share.tenants
        if len(tenant_names) > 1 and all(name in tenants and tenants[name].num_waiting for name in tenant_names):
            backlogged_tokens.update(scheduler.requests[token.request_id].tenant.name for token in result.sampled)
        scheduled_ids = [r.request_id for r in step.new_requests] + [r.request_id for r in step.running_requests]
        context = sum(worker.requests[request_id].num_computed_tokens for request_id in scheduled_ids)
        duration = result.compute_s = cost.step_time(step.num_scheduled_tokens, context)  # what the scheduler learns
        usage_time += scheduler.kv.pool.usage * duration
        now += duration
        steps += 1
        finished += engine.complete(result, now).finished
    return _report(trace, finished, rejected, now, steps, usage_time, scheduler, backlogged_tokens)


def _by_tenant(done: list[Request], duration_s: float, backlogged_tokens: Counter) -> dict[str, dict[str, float]]:
    """Per tenant: finished requests, output tokens per second over the run, TTFT p50, and the output tokens it
    was given while every tenant had requests waiting (where a fair share shows)."""
    report = {}
    for name in sorted({request.tenant.name for request in done}):
        mine = [request for request in done if request.tenant.name == name]
        report[name] = {
            "num_finished": len(mine),
            "output_tokens_per_s": sum(request.num_output_tokens for request in mine) / duration_s,
            "ttft_p50_s": float(np.percentile([r.first_token_time - r.arrival_time for r in mine], 50)),
            "output_tokens_while_all_backlogged": backlogged_tokens[name],
        }
    return report


def _report(
    trace, finished: list[Request], rejected, now, steps, usage_time, scheduler, backlogged_tokens: Counter
) -> SimulationReport:
    done = [r for r in finished if r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)]
    start = min((r.arrival_time_s for r in trace), default=0.0)
    duration = max(now - start, 1e-9)
    ttft = np.array([r.first_token_time - r.arrival_time for r in done] or [0.0])
    high_ttft = np.array([r.first_token_time - r.arrival_time for r in done if r.priority < 0] or [0.0])
    tpot = np.array(
        [(r.finish_time - r.first_token_time) / (r.num_output_tokens - 1) for r in done if r.num_output_tokens > 1]
        or [0.0]
    )
    return SimulationReport(
        num_requests=len(trace),
        num_finished=len(done),
        num_rejected=rejected,
        num_failed=sum(1 for r in finished if r.finish_reason is FinishReason.ERROR),
        duration_s=duration,
        output_tokens_per_s=sum(r.num_output_tokens for r in done) / duration,
        requests_per_s=len(done) / duration,
        num_steps=steps,
        num_preemptions=scheduler.counters.num_preemptions,
        num_recomputed_tokens=scheduler.counters.num_recomputed_tokens,
        mean_kv_usage=usage_time / duration,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        tpot_p50_s=float(np.percentile(tpot, 50)),
        tpot_p99_s=float(np.percentile(tpot, 99)),
        high_priority_ttft_p50_s=float(np.percentile(high_ttft, 50)),
        high_priority_ttft_p99_s=float(np.percentile(high_ttft, 99)),
        by_tenant=_by_tenant(done, duration, backlogged_tokens),
    )
