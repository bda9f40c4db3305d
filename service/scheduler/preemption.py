"""Preemption in the unified table: which running request gives its blocks back, and how.

A victim gives back every block and goes back to the waiting queue (fcfs: its front; priority:
its own place) to be recomputed; the blocks it had cached stay findable in the prefix cache until
evicted, so it recomputes only what was lost. Victims come from the lowest priority first, then
by the victim policy (a function from the candidates to one of them); a request is never
preempted for one of lower priority. The most important running request (the longest-running
under fcfs) is never a candidate, so one request always progresses.
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


def importance(request: Request) -> tuple[int, int]:
    """Sorts the most important running request first: best priority, then longest-running."""
    return request.priority, request.admitted_seq


class RecomputePreemption:
    requeues_victims = True  # a victim leaves the running set for the front of the waiting queue

    def __init__(self, kv: KVCacheManager, policy: str):
        self.kv = kv
        self.policy = POLICIES[policy]

    def choose_victim(self, requester: Request, running: list[Request]) -> Request:
        """The request to preempt so that `requester` can grow (the requester itself if nobody else)."""
        protected = min(running, key=importance)
        candidates = [r for r in running if r is not protected and r.priority >= requester.priority]
        return self.lowest_priority_victim(candidates or [requester])

    def lowest_priority_victim(self, candidates: list[Request]) -> Request:
        """From the lowest priority among `candidates`, the one the victim policy picks."""
        lowest = max(r.priority for r in candidates)
        return self.policy([r for r in candidates if r.priority == lowest], self.kv)

    def preempt(self, victim: Request) -> str | None:
        """Give back the victim's blocks; a reason if it must end instead (never, here)."""
        self.kv.free(victim)
        return None
