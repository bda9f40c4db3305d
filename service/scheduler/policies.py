"""Preemption victim policies: which running request gives its blocks back.

A policy is a function from the candidates (running requests that may be preempted) to one
of them. The scheduler never offers the longest-running request, so it always progresses.
"""

from __future__ import annotations

from typing import Callable

from service.scheduler.block_pool import BlockPool
from service.scheduler.request import Request

VictimPolicy = Callable[[list[Request], BlockPool], Request]


def lifo(candidates: list[Request], pool: BlockPool) -> Request:
    """The most recently admitted request (what FastDeploy v1 and vLLM do)."""
    return max(candidates, key=lambda request: request.admitted_seq)


def recompute_cost(request: Request, pool: BlockPool) -> int:
    """Tokens the request must compute again if preempted now.

    Leading blocks another live request also holds stay in the cache for sure, so they are
    not counted; the rest are, since memory pressure is what evicts freed blocks.
    """
    kept_blocks = 0
    for block_id in request.block_ids:
        if pool.blocks[block_id].ref_count < 2:
            break
        kept_blocks += 1
    return max(0, request.num_computed_tokens - kept_blocks * pool.block_size)


def min_recompute(candidates: list[Request], pool: BlockPool) -> Request:
    """The request whose recomputation costs least; the newest among equals."""
    return min(candidates, key=lambda request: (recompute_cost(request, pool), -request.admitted_seq))


POLICIES: dict[str, VictimPolicy] = {"lifo": lifo, "min_recompute": min_recompute}
