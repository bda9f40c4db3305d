"""The one engine loop: drives a Scheduler step by step for the server, the simulator and the tests.

Serial: one step in flight. Overlapped: two (one computing, one queued at the worker), so the
worker never waits for the scheduler; results come back in the order steps were sent. A worker
that registers gets an engine of its own (`for_worker`), whose scheduler's first step tells it
to drop whatever state it still holds. When the worker is lost, every request ends.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from service.contract import wire
from service.scheduler.counters import SchedulerCounters
from service.scheduler.outcome import StepOutcome
from service.scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig, build_scheduler
from service.scheduler.split_table import split_table_config_from

MAX_STEPS_IN_FLIGHT = 2


class EngineLoop:
    def __init__(self, scheduler: Scheduler, overlapped: bool):
        self.scheduler = scheduler
        self.max_in_flight = MAX_STEPS_IN_FLIGHT if overlapped else 1
        self.in_flight: deque[ScheduledStep] = deque()

    @classmethod
    def for_worker(cls, settings, hello: wire.WorkerHello, counters: SchedulerCounters) -> "EngineLoop":
        """The engine for a worker that registers: its table and model within the settings' limits."""
        config = SchedulerConfig.from_settings(
            settings,
            min(hello.num_kv_blocks, settings.num_kv_blocks or hello.num_kv_blocks),
            block_size=hello.block_size,
            max_model_len=min(hello.model.max_model_len, settings.max_model_len or hello.model.max_model_len),
            eos_token_ids=tuple(hello.model.eos_token_ids),
            vocab_size=hello.model.vocab_size,
        )
        scheduler = build_scheduler(config, split_table_config_from(settings), counters)
        return cls(scheduler, settings.async_scheduling)

    def run(self, now: float, send: Callable[[ScheduledStep], None]) -> None:
        """Schedule steps while the loop allows and hand each to `send` (serial: one in flight; overlapped: two).

        A step with nothing to compute (at most state to drop, or requests it ended) is handed over
        too, but no result is expected for it and the loop stops there."""
        while len(self.in_flight) < self.max_in_flight and self.scheduler.has_work:
            started = time.perf_counter()
            step = self.scheduler.schedule(now)
            step.schedule_s = time.perf_counter() - started
            if step.needs_result:
                self.in_flight.append(step)
            send(step)
            if not step.needs_result:
                return

    def complete(self, result: wire.StepResult, now: float) -> StepOutcome | None:
        """Apply the result of the oldest step in flight; None if `result` answers no such step."""
        if not self.in_flight or result.step_id != self.in_flight[0].step_id:
            return None
        return self.scheduler.update(self.in_flight.popleft(), result, now)

    def fail(self, message: str, now: float, error_status: int = 503) -> StepOutcome:
        """Every request ends with `message`; what is in flight is forgotten (the worker is gone, or its
        results can no longer be applied)."""
        self.in_flight.clear()
        return self.scheduler.fail_all(message, now, error_status)
