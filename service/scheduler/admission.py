"""Which waiting requests the unified table admits, beside a reserve for the running ones.

A request is admitted only if its whole remaining prompt fits beside what the running requests
still owe: unfinished prompts in full, future output by a share that adapts as SGLang's
new_token_ratio does (it decays each step towards `min_ratio`, and jumps back to `init_ratio`
after a preemption). A head that does not fit lets `max_skip_ahead` others be looked at; once
passed over in `max_head_skips` rounds, nobody passes it and freed blocks drain to it. A request whose
tenant runs its most (`tenant_max_running`) is set aside, not passed over: it waits for its tenant.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import NamedTuple

from service.scheduler.fair_share import Tenant
from service.scheduler.kv_cache_manager import KVCacheManager
from service.scheduler.request import Request


class Admitted(NamedTuple):
    """A request admitted this step, its blocks allocated."""

    request: Request
    num_cached_tokens: int  # its prefix found in the prefix cache
    num_new_tokens: int  # to compute in this step
    block_ids: list[int]


class ReserveAdmission:
    def __init__(
        self,
        kv: KVCacheManager,
        max_skip_ahead: int = 8,
        max_head_skips: int = 32,
        init_ratio: float = 0.7,
        min_ratio: float = 0.1,
        decay_steps: int = 600,
        tenant_max_running: int = 0,
    ):
        self.kv = kv
        self.tenant_max_running = tenant_max_running
        self.max_skip_ahead = max_skip_ahead
        self.max_head_skips = max_head_skips
        self.init_ratio = init_ratio
        self.min_ratio = min_ratio
        self.decay = (init_ratio - min_ratio) / decay_steps
        self.ratio = init_ratio

    def on_step(self) -> None:
        self.ratio = max(self.min_ratio, self.ratio - self.decay)

    def on_preemption(self) -> None:
        self.ratio = self.init_ratio

    def reserved_blocks(self) -> int:
        """Blocks kept free for the running requests: unfinished prompts in full, future output scaled."""
        return self.kv.owed_prompt_blocks + math.ceil(self.ratio * self.kv.owed_output_blocks)

    def reserve_of(self, requests: list[Request]) -> int:
        """The part of the reserve that these running requests hold (what preempting them would release)."""
        owed = [self.kv.owed_blocks(request) for request in requests]
        return sum(prompt for prompt, _ in owed) + math.floor(self.ratio * sum(output for _, output in owed))

    def fits(self, request: Request, num_blocks_freed: int = 0) -> bool:
        """Whether the request's whole remaining prompt fits beside the reserve (with `num_blocks_freed` more free)."""
        computed_blocks = self.kv.get_computed_blocks(request)
        return self.kv.fits(request, request.num_tokens, computed_blocks, self.reserved_blocks() - num_blocks_freed)

    def admit(
        self,
        waiting: deque[Request],
        budget: int,
        num_seats: int,
        priority_below: float = float("inf"),
        tenants_set_aside: frozenset[Tenant] = frozenset(),
    ) -> list[Admitted]:
        """Take the requests to admit off `waiting`, up to the first whose priority is not below
        `priority_below`, passing over those of `tenants_set_aside`; the others stay in order."""
        kv, size = self.kv, self.kv.block_size
        reserved = self.reserved_blocks()
        admitted: list[Admitted] = []
        passed: list[Request] = []
        set_aside: list[Request] = []  # passed over, and those whose tenant runs its most: back in order
        admitted_of: Counter[Tenant] = Counter()
        while waiting and budget > 0 and len(admitted) < num_seats and len(passed) <= self.max_skip_ahead:
            request = waiting.popleft()
            if request.priority >= priority_below:
                waiting.appendleft(request)
                break
            if request.tenant in tenants_set_aside:
                set_aside.append(request)
                continue
            if self.tenant_max_running and (
                request.tenant.num_running + admitted_of[request.tenant] >= self.tenant_max_running
            ):
                set_aside.append(request)
                continue
            computed_blocks = kv.get_computed_blocks(request)
            num_cached = len(computed_blocks) * size
            num_new = min(request.num_tokens - num_cached, budget)
            block_ids = kv.allocate_slots(
                request,
                num_cached + num_new,
                computed_blocks,
                num_tokens_to_fit=request.num_tokens,
                num_blocks_to_keep_free=reserved,
            )
            if block_ids is None:
                request.num_skipped += not passed
                passed.append(request)
                set_aside.append(request)
                if request.num_skipped > self.max_head_skips:
                    break  # aged head: nobody passes it any more, blocks drain to it
                continue
            reserved = self.reserved_blocks()
            admitted.append(Admitted(request, num_cached, num_new, block_ids))
            admitted_of[request.tenant] += 1
            budget -= num_new
        waiting.extendleft(reversed(set_aside))
        return admitted
