"""The one way to drive a Scheduler step by step: the server, the simulator and the tests use it.

Serial: one step in flight; the next is scheduled once its result is in. Overlapped: up to two
in flight (one computing, one queued at the worker), so the worker never waits for the
scheduler; results come back in the order steps were sent.
"""

from __future__ import annotations

from collections import deque

from service import wire
from service.scheduler.outcome import StepOutcome
from service.scheduler.scheduler import ScheduledStep, Scheduler

MAX_STEPS_IN_FLIGHT = 2


class StepLoop:
    def __init__(self, scheduler: Scheduler, overlapped: bool):
        self.scheduler = scheduler
        self.overlapped = overlapped
        self.max_in_flight = MAX_STEPS_IN_FLIGHT if overlapped else 1
        self.in_flight: deque[ScheduledStep] = deque()

    def can_schedule(self) -> bool:
        return len(self.in_flight) < self.max_in_flight and self.scheduler.has_work

    def schedule(self, now: float) -> ScheduledStep:
        """The next step; it counts as in flight if the worker will answer it."""
        step = self.scheduler.schedule(now)
        if step.needs_result:
            self.in_flight.append(step)
        return step

    def complete(self, result: wire.StepResult, now: float) -> StepOutcome | None:
        """Apply the result of the oldest step in flight; None if `result` answers no such step."""
        if not self.in_flight or result.step_id != self.in_flight[0].step_id:
            return None
        return self.scheduler.update(self.in_flight.popleft(), result, now)

    def fail(self, message: str, now: float) -> StepOutcome:
        """The worker is gone: nothing in flight will return; every request ends with `message`."""
        self.in_flight.clear()
        return self.scheduler.fail_all(message, now)
