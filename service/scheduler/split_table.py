"""The split-table baseline (`ENABLE_V1_KVCACHE_SCHEDULER=0`): FastDeploy's v0 block management.

Every claim about the unified table is measured against it, on the same scheduler and worker.
The pool is split by `KV_CACHE_RATIO` into a prefill share and a decode share (quotas):

- admission takes `ceil((prompt_len + dec_token_num) / block_size)` blocks from the prefill
  share, whole prompt at once, first come first served (the unified admission with no reserve
  and no skip-ahead, `build_scheduler`);
- a sequence that outgrows them takes blocks from the decode share, one step at a time;
- when the decode share is empty, the running request holding the most decode blocks loses
  them (its prompt blocks and its seat stay), is suspended, and is recovered by recomputing
  prompt and output once its whole sequence fits the decode share again; with recovery
  disabled it ends with an "incomplete" error instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.scheduler.kv_cache_manager import KVCacheManager, blocks_for
from service.scheduler.request import Request

INCOMPLETE = "incomplete: the decode table ran out of blocks and recovery is disabled"
TOO_LONG = "incomplete: the output needs more blocks than the decode table holds"


@dataclass(frozen=True, slots=True)
class SplitTableConfig:
    kv_cache_ratio: float = 0.75
    dec_blocks: int = 2  # `enc_dec_block_num`: decode blocks taken with the prompt at admission
    disable_recover: bool = False


def split_table_config_from(settings) -> SplitTableConfig | None:
    """The split-table configuration when `ENABLE_V1_KVCACHE_SCHEDULER=0`, else None."""
    if settings.enable_v1_kvcache_scheduler:
        return None
    return SplitTableConfig(settings.kv_cache_ratio, settings.legacy_dec_blocks, settings.legacy_disable_recover)


class SplitTableKVCacheManager(KVCacheManager):
    """Prefill and decode shares of one pool, with no prefix cache (v0 had none here)."""

    def __init__(self, num_blocks: int, block_size: int, split: SplitTableConfig):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.split = split
        self.prefill_capacity = int(num_blocks * split.kv_cache_ratio)
        self.decode_capacity = num_blocks - self.prefill_capacity
        self.prefill_used = 0
        self.decode_used = 0
        self._num_prefill_blocks: dict[Request, int] = {}  # how many of a request's blocks are the prefill share's
        self._suspended: dict[Request, list[int]] = {}  # its prompt blocks, kept while it lacks decode blocks

    def pool_usage(self) -> list[tuple[str, int, int]]:
        return [
            ("prefill", self.prefill_capacity, self.prefill_used),
            ("decode", self.decode_capacity, self.decode_used),
        ]

    def admission_blocks(self, num_prompt_tokens: int) -> int:
        return blocks_for(num_prompt_tokens + self.split.dec_blocks * self.block_size, self.block_size)

    def admission_problem(self, num_prompt_tokens: int, max_num_tokens: int) -> str | None:
        needed = self.admission_blocks(num_prompt_tokens)
        if needed > self.prefill_capacity:
            return (
                f"the prompt needs {needed} prefill blocks but the prefill table holds {self.prefill_capacity} "
                f"(KV_CACHE_RATIO={self.split.kv_cache_ratio})"
            )
        return super().admission_problem(num_prompt_tokens, max_num_tokens)

    def block_ids(self, request: Request) -> list[int]:
        """Its blocks; a suspended request's prompt blocks, which it keeps."""
        return self._suspended.get(request) or super().block_ids(request)

    def decode_blocks(self, request: Request) -> int:
        """Blocks the request holds from the decode share (none while suspended)."""
        held = self.block_ids(request)
        return len(held) - self._num_prefill_blocks[request] if held else 0

    def is_suspended(self, request: Request) -> bool:
        return request in self._suspended

    def can_ever_recover(self, request: Request) -> bool:
        """Whether the suspended request's whole sequence fits the decode share at all."""
        return self._recovery_blocks(request) <= self.decode_capacity

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        computed_blocks: list[int] | None = None,
        num_tokens_to_fit: int = 0,
        num_blocks_to_keep_free: int = 0,
    ) -> list[int] | None:
        """Admission: the prompt's blocks from the prefill share. Growth: blocks from the decode
        share. Recovery of a suspended request: its whole sequence's, from the decode share."""
        if request in self._suspended:
            needed = self._recovery_blocks(request)
            if self.decode_used + needed > self.decode_capacity:
                return None
            self.decode_used += needed
            return self._take(request, self._suspended.pop(request) + self.pool.allocate(needed))
        if (num_held := len(self.block_ids(request))) == 0:
            needed = self.admission_blocks(len(request.token_ids))
            if self.prefill_used + needed > self.prefill_capacity:
                return None
            self.prefill_used += needed
            self._num_prefill_blocks[request] = needed
            return self._take(request, self.pool.allocate(needed))
        needed = blocks_for(num_tokens, self.block_size) - num_held
        if needed <= 0:
            return []
        if self.decode_used + needed > self.decode_capacity:
            return None
        self.decode_used += needed
        return self._take(request, self.pool.allocate(needed))

    def suspend(self, request: Request) -> None:
        """Give back the request's decode blocks; keep its prompt blocks for its recovery."""
        block_ids = self._drop(request).block_ids
        num_prefill = self._num_prefill_blocks[request]
        self.decode_used -= len(block_ids) - num_prefill
        self.pool.free(block_ids[num_prefill:])
        self._suspended[request] = block_ids[:num_prefill]
        self.num_slots[request] = 0  # nothing to compute into until it is recovered

    def free(self, request: Request) -> None:
        num_prefill = self._num_prefill_blocks.pop(request, 0)
        self.prefill_used -= num_prefill
        if (kept := self._suspended.pop(request, None)) is not None:
            del self.num_slots[request]
            self.pool.free(kept)
        elif (held := self._drop(request)) is not None:
            self.decode_used -= len(held.block_ids) - num_prefill
            self.pool.free(held.block_ids)

    def _recovery_blocks(self, request: Request) -> int:
        return blocks_for(len(request.token_ids), self.block_size) - len(self._suspended[request])


class SuspendPreemption:
    """The request holding the most decode blocks is suspended: it keeps its seat and prompt blocks."""

    requeues_victims = False

    def __init__(self, kv: SplitTableKVCacheManager, disable_recover: bool):
        self.kv = kv
        self.disable_recover = disable_recover

    def choose_victim(self, requester: Request, running: list[Request]) -> Request | None:
        """None: the requester is suspended and waits for decode blocks (nobody is suspended for it)."""
        if self.kv.is_suspended(requester):
            return None if self.kv.can_ever_recover(requester) else requester
        victim = max(running, key=self.kv.decode_blocks)
        return victim if self.kv.decode_blocks(victim) > 0 else requester

    def preempt(self, victim: Request) -> str | None:
        """Suspend the victim; the reason it ends instead when it has nothing to give back or recovery is off."""
        if self.kv.is_suspended(victim) or self.kv.decode_blocks(victim) == 0:
            return TOO_LONG  # it alone needs more than the decode table
        if self.disable_recover:
            return INCOMPLETE
        self.kv.suspend(victim)
        return None
