"""Counters the scheduler keeps about itself (read by metrics and the simulator)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from service.scheduler.request import Request


@dataclass(slots=True)
class SchedulerCounters:
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_prompt_tokens: int = 0  # counted at first admission
    num_generation_tokens: int = 0  # counted as each token is accepted
    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    num_wasted_decode_slots: int = 0  # tokens computed for requests that had ended while their step ran
    num_step_cost_errors: int = 0  # the step cost model failed to learn or to size a chunk (scheduling went on)
    finished_by_reason: Counter = field(default_factory=Counter)

    def record_finish(self, request: Request) -> None:
        self.finished_by_reason[request.finish_reason.value] += 1
