"""How many free blocks admission keeps back for requests already running.

A running request still owes the blocks of its unfinished prompt (all of them) and of its
future output (a share of them). The share adapts, as SGLang's new_token_ratio does: it decays
every step towards `min_ratio`, so the cache fills up when outputs end early, and jumps back
to `init_ratio` after a preemption, so admission stops causing preemptions.
"""

from __future__ import annotations

import math
from typing import Iterable

from service.scheduler.request import Request

MAX_OUTPUT_TOKENS_CONSIDERED = 4096


class AdmissionReserve:
    def __init__(self, init_ratio: float = 0.7, min_ratio: float = 0.1, decay_steps: int = 600):
        self.init_ratio = init_ratio
        self.min_ratio = min_ratio
        self.decay = (init_ratio - min_ratio) / decay_steps
        self.ratio = init_ratio

    def on_step(self) -> None:
        self.ratio = max(self.min_ratio, self.ratio - self.decay)

    def on_preemption(self) -> None:
        self.ratio = self.init_ratio

    def reserved_blocks(self, requests: Iterable[Request], max_model_len: int, block_size: int) -> int:
        """Blocks to keep free for `requests`: unfinished prompts in full, future output scaled."""
        prompt_blocks = 0
        output_blocks = 0
        for request in requests:
            held = len(request.block_ids)
            prompt_end = -(-request.num_tokens // block_size)
            prompt_blocks += max(0, prompt_end - held)
            remaining_output = min(
                request.sampling.max_tokens - request.num_output_tokens,
                max_model_len - request.num_tokens,
                MAX_OUTPUT_TOKENS_CONSIDERED,
            )
            final_end = -(-(request.num_tokens + remaining_output - 1) // block_size)
            output_blocks += max(0, final_end - max(held, prompt_end))
        return prompt_blocks + math.ceil(self.ratio * output_blocks)
