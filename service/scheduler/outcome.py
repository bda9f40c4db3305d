"""What one call into the scheduler produced: deltas for each api replica and the requests that ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from service import wire
from service.scheduler.request import Request


@dataclass(slots=True)
class StepOutcome:
    """Everything a `schedule()`, `update()`, `abort_request()` or `fail_all()` call produced."""

    deltas: dict[bytes, list[wire.RequestDelta]] = field(default_factory=dict)  # owner -> its deltas, in order
    sampled: list[Request] = field(default_factory=list)  # got a token (their timings say when)
    finished: list[Request] = field(default_factory=list)  # ended, with their timings

    def add(self, request: Request, delta: wire.RequestDelta) -> None:
        owned = self.deltas.get(request.owner)
        if owned is None:
            self.deltas[request.owner] = [delta]
        else:
            owned.append(delta)

    def extend(self, other: "StepOutcome") -> None:
        for owner, deltas in other.deltas.items():
            self.deltas.setdefault(owner, []).extend(deltas)
        self.sampled.extend(other.sampled)
        self.finished.extend(other.finished)

    def all_deltas(self) -> list[wire.RequestDelta]:
        return [delta for deltas in self.deltas.values() for delta in deltas]
