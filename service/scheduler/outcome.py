"""What one call into the scheduler produced: deltas for each api replica and the requests that ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.contract import wire
from service.scheduler.request import Request


@dataclass(slots=True)
class StepOutcome:
    """Everything a `schedule()`, `update()`, `abort_request()` or `fail_all()` call produced."""

    # owner -> its plain tokens (no logprobs, not a request's last) as columns: request ids, token ids
    tokens: dict[bytes, tuple[list[str], list[int]]] = field(default_factory=dict)
    deltas: dict[bytes, list[wire.RequestDelta]] = field(default_factory=dict)  # owner -> its other deltas, in order
    first_tokens: list[Request] = field(default_factory=list)  # got their first token (their timings say when)
    token_gaps_s: list[float] = field(default_factory=list)  # for every other token: the time since the one before
    finished: list[Request] = field(default_factory=list)  # ended, with their timings
    # Hashes the prefix cache gained (True) or evicted (False) meanwhile, in order (for the api's router).
    cache_events: tuple[list[int], list[bool]] = ((), ())

    def add(self, request: Request, delta: wire.RequestDelta) -> None:
        self.deltas.setdefault(request.owner, []).append(delta)

    @property
    def num_tokens(self) -> int:
        return len(self.first_tokens) + len(self.token_gaps_s)

    def batches(self) -> dict[bytes, wire.DeltaBatch]:
        """One frame's worth for each api replica."""
        batches = {
            owner: wire.DeltaBatch(token_request_ids=request_ids, token_ids=token_ids)
            for owner, (request_ids, token_ids) in self.tokens.items()
        }
        for owner, deltas in self.deltas.items():
            if owner in batches:
                batches[owner].deltas = deltas
            else:
                batches[owner] = wire.DeltaBatch(deltas=deltas)
        return batches

    def all_deltas(self) -> list[wire.RequestDelta]:
        """Every owner's batch as one delta per entry, in the order each owner applies them."""
        return [delta for batch in self.batches().values() for delta in batch.all_deltas()]
