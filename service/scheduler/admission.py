"""How many free blocks admission keeps back for requests already running.

A running request still owes the blocks of its unfinished prompt (all of them) and of its
future output (a share of them). The share adapts, as SGLang's new_token_ratio does: it decays
every step towards `min_ratio`, so the cache fills up when outputs end early, and jumps back
to `init_ratio` after a preemption, so admission stops causing preemptions.

The sums over running requests are kept incrementally: a request's share only changes when it
gets blocks, when a token opens a new block, or while its output is capped (`refresh_after_token`).
"""

from __future__ import annotations

import math

from service.scheduler.request import Request

MAX_OUTPUT_TOKENS_CONSIDERED = 4096


class AdmissionReserve:
    def __init__(self, block_size: int, init_ratio: float = 0.7, min_ratio: float = 0.1, decay_steps: int = 600):
        self.block_size = block_size
        self.init_ratio = init_ratio
        self.min_ratio = min_ratio
        self.decay = (init_ratio - min_ratio) / decay_steps
        self.ratio = init_ratio
        self.prompt_blocks = 0  # sum of the tracked requests' unfinished-prompt blocks
        self.output_blocks = 0  # sum of their future-output blocks (before scaling)

    def on_step(self) -> None:
        self.ratio = max(self.min_ratio, self.ratio - self.decay)

    def on_preemption(self) -> None:
        self.ratio = self.init_ratio

    def reserved_blocks(self) -> int:
        """Blocks to keep free for the tracked requests: unfinished prompts in full, future output scaled."""
        return self.prompt_blocks + math.ceil(self.ratio * self.output_blocks)

    def owed_blocks(self, request: Request) -> tuple[int, int]:
        """(unfinished-prompt blocks, future-output blocks) that `request` still needs."""
        size = self.block_size
        held = len(request.block_ids)
        num_tokens = len(request.token_ids)
        prompt_end = -(-num_tokens // size)
        final_end = -(-(min(request.max_num_tokens, num_tokens + MAX_OUTPUT_TOKENS_CONSIDERED) - 1) // size)
        return max(0, prompt_end - held), max(0, final_end - max(held, prompt_end))

    def track(self, request: Request) -> None:
        request.reserve_prompt_blocks, request.reserve_output_blocks = self.owed_blocks(request)
        request.in_reserve = True
        self.prompt_blocks += request.reserve_prompt_blocks
        self.output_blocks += request.reserve_output_blocks

    def untrack(self, request: Request) -> None:
        if request.in_reserve:
            self.prompt_blocks -= request.reserve_prompt_blocks
            self.output_blocks -= request.reserve_output_blocks
            request.in_reserve = False

    def refresh(self, request: Request) -> None:
        if request.in_reserve:
            self.untrack(request)
            self.track(request)

    def refresh_after_token(self, request: Request) -> None:
        """A new token changes the share only if it opens a block or the output is capped."""
        num_tokens = len(request.token_ids)
        if num_tokens % self.block_size == 1 or request.max_num_tokens - num_tokens > MAX_OUTPUT_TOKENS_CONSIDERED:
            self.refresh(request)
