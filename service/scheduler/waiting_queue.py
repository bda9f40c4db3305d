"""The waiting queues of the `priority` and `fair` policies (fcfs uses a deque).

Under `BLOCKSERVE_SCHEDULING_POLICY=priority`: best (priority, arrival) first, with aging.

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
from collections import Counter
from typing import Iterable, Iterator

from service.scheduler.fair_share import FairShare, Tenant
from service.scheduler.request import Request, RequestStatus


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


class FairWaitingQueue:
    """The waiting queue under `BLOCKSERVE_SCHEDULING_POLICY=fair` (fair_share.py): one priority queue per
    tenant. The next request is the best of the backlogged tenant served least. Taking a request off
    charges its tenant the prompt (if it never ran), so one admission round turns to the next tenant as
    counters pass each other; a request put back without having run is refunded. The interface is the
    deque's that fcfs uses."""

    def __init__(self, fair_share: FairShare, aging_s: float, tenant_max_running: int = 0):
        self.fair_share = fair_share
        self.aging_s = aging_s
        self.tenant_max_running = tenant_max_running or float("inf")
        self._queues: dict[Tenant, PriorityWaitingQueue] = {}
        self._taken: dict[Request, bool] = {}  # taken off, not yet run nor put back -> its prompt was charged
        self._num_taken: Counter[Tenant] = Counter()
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def __bool__(self) -> bool:
        return self._length > 0

    def __iter__(self) -> Iterator[Request]:
        return (request for queue in self._queues.values() for request in queue)

    def append(self, request: Request) -> None:
        tenant = request.tenant
        if (charged := self._taken.pop(request, None)) is not None:  # passed over: it did not run
            self._num_taken[tenant] -= 1
            if charged:
                self.fair_share.charge_prompt(tenant, -request.num_tokens)
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = PriorityWaitingQueue(self.aging_s)
        queue.append(request)
        self._length += 1

    appendleft = append  # a request that goes back keeps its place: its key says where

    def extendleft(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def popleft(self) -> Request:
        request = self._queue_of_next().popleft()
        self._length -= 1
        charged = self._taken[request] = request.status is RequestStatus.WAITING  # never ran: its prompt is owed
        self._num_taken[request.tenant] += 1
        if charged:
            self.fair_share.charge_prompt(request.tenant, request.num_tokens)
        return request

    def peek(self) -> Request:
        return self._queue_of_next().peek()

    def ran(self, request: Request) -> None:
        """The request taken off was admitted: its charge stands."""
        if self._taken.pop(request, None) is not None:
            self._num_taken[request.tenant] -= 1

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)
        self._length -= 1

    def clear(self) -> None:
        self._queues.clear()
        self._taken.clear()
        self._num_taken.clear()
        self._length = 0

    def _queue_of_next(self) -> PriorityWaitingQueue:
        """The queue of the backlogged tenant served least (ties: the one running fewest for its weight, then
        the longest waiting head); tenants that run their most requests (`tenant_max_running`) last."""
        num_taken, max_running = self._num_taken, self.tenant_max_running

        def order(queue: PriorityWaitingQueue) -> tuple[bool, float, float, float]:
            head = queue.peek()
            tenant = head.tenant
            seats = tenant.num_running + num_taken[tenant]
            return seats >= max_running, tenant.served, seats / tenant.weight, head.arrival_time

        return min((queue for queue in self._queues.values() if queue), key=order)
