"""The waiting queue under `BLOCKSERVE_SCHEDULING_POLICY=priority`: best (priority, arrival) first, with aging.

A request of priority p that arrived at t is served as if it had arrived at t + p × aging_s: lower
priorities go first, and waiting makes a request more important at the same pace for everyone, so
the order never changes while requests wait. The bound this gives: a request is passed over by one
of a better priority q < p only if that one arrived less than (p − q) × aging_s after it. A request
that goes back to the queue (preempted) keeps its place. The interface is the deque's that the
fcfs policy uses.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterable, Iterator

from service.scheduler.request import Request


def priority_key(request: Request, aging_s: float) -> float:
    """Lower is served first: arrival time moved back by the priority's worth of waiting."""
    return request.arrival_time + request.priority * aging_s


class PriorityWaitingQueue:
    def __init__(self, aging_s: float):
        self.aging_s = aging_s
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()  # equal keys: first come, first served

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, _, request in self._heap)

    def append(self, request: Request) -> None:
        if request.queued_seq < 0:  # back again (preempted, passed over): its first number keeps its place
            request.queued_seq = next(self._order)
        heapq.heappush(self._heap, (priority_key(request, self.aging_s), request.queued_seq, request))

    appendleft = append  # a preempted request keeps its place: its key says where

    def extendleft(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def popleft(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def peek(self) -> Request:
        return self._heap[0][2]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()
