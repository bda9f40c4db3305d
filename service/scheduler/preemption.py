"""Preemption in the unified table: which running request gives its blocks back, and how.

A victim gives back every block and waits at the front of the queue to be recomputed; the
blocks it had cached stay findable in the prefix cache until evicted, so it recomputes only
what was lost. The victim policy is a function from the candidates to one of them; the
longest-running request is never a candidate, so one request always progresses.
"""

from __future__ import annotations

from typing import Callable

from service.scheduler.kv_cache_manager import KVCacheManager
from service.scheduler.request import Request

VictimPolicy = Callable[[list[Request], KVCacheManager], Request]


def lifo(candidates: list[Request], kv: KVCacheManager) -> Request:
    """The most recently admitted request (what FastDeploy v1 and vLLM do)."""
    return max(candidates, key=lambda request: request.admitted_seq)


def min_recompute(candidates: list[Request], kv: KVCacheManager) -> Request:
    """The request whose recomputation costs least; the newest among equals."""
    return min(candidates, key=lambda request: (kv.recompute_cost(request), -request.admitted_seq))


POLICIES: dict[str, VictimPolicy] = {"lifo": lifo, "min_recompute": min_recompute}


class RecomputePreemption:
    requeues_victims = True  # a victim leaves the running set for the front of the waiting queue

    def __init__(self, kv: KVCacheManager, policy: str):
        self.kv = kv
        self.policy = POLICIES[policy]

    def choose_victim(self, requester: Request, running: list[Request]) -> Request:
        """The request to preempt so that `requester` can grow (the requester itself if nobody else)."""
        return self.policy(running[1:] or [requester], self.kv)

    def preempt(self, victim: Request) -> str | None:
        """Give back the victim's blocks; a reason if it must end instead (never, here)."""
        self.kv.free(victim)
        return None
