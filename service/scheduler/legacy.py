"""The legacy split-table scheduler (`ENABLE_V1_KVCACHE_SCHEDULER=0`), kept as a baseline.

It reproduces FastDeploy's v0 block management on the same worker, so every claim about the
unified table is measured against it. The table is split by `KV_CACHE_RATIO` into a prefill
share and a decode share (quotas over the one physical pool):

- admission takes `ceil((prompt_len + dec_token_num) / block_size)` blocks from the prefill
  share, whole prompt at once, first come first served;
- a sequence that outgrows them takes blocks from the decode share, one step at a time;
- when the decode share is empty, the running request holding the most decode blocks loses
  them (its prompt blocks and batch slot stay), is suspended, and is recovered later by
  recomputing prompt and output once enough decode blocks are free; with recovery disabled it
  ends with an "incomplete" error instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from service import wire
from service.scheduler.outcome import StepOutcome
from service.scheduler.request import FinishReason, Request, RequestStatus
from service.scheduler.scheduler import RequestRejected, Scheduler, SchedulerConfig, blocks_for
from service.scheduler.stats import SchedulerStats

INCOMPLETE = "incomplete: the decode table ran out of blocks and recovery is disabled"
TOO_LONG = "incomplete: the output needs more blocks than the decode table holds"


@dataclass(frozen=True, slots=True)
class LegacyConfig:
    kv_cache_ratio: float = 0.75
    dec_blocks: int = 2  # `enc_dec_block_num`: decode blocks taken with the prompt at admission
    disable_recover: bool = False


class LegacyScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, legacy: LegacyConfig, stats: SchedulerStats | None = None):
        super().__init__(replace(config, enable_prefix_caching=False), stats)  # v0 had no prefix cache here
        self.legacy = legacy
        self.prefill_capacity = int(config.num_blocks * legacy.kv_cache_ratio)
        self.decode_capacity = config.num_blocks - self.prefill_capacity
        self.prefill_used = 0
        self.decode_used = 0
        self._prefill_blocks: dict[str, int] = {}  # request id -> how many of its blocks are prefill share

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: wire.SamplingParams,
        now: float,
        owner: bytes = b"",
    ) -> None:
        needed = self._admission_blocks(len(prompt_token_ids))
        if needed > self.prefill_capacity:
            raise RequestRejected(
                f"the prompt needs {needed} prefill blocks but the prefill table holds {self.prefill_capacity} "
                f"(KV_CACHE_RATIO={self.legacy.kv_cache_ratio})"
            )
        super().add_request(request_id, prompt_token_ids, sampling, now, owner)

    def pool_usage(self) -> list[tuple[str, int, int]]:
        """(pool, capacity, used blocks) of the prefill and decode tables."""
        return [
            ("prefill", self.prefill_capacity, self.prefill_used),
            ("decode", self.decode_capacity, self.decode_used),
        ]

    def decode_blocks(self, request: Request) -> int:
        return len(request.block_ids) - self._prefill_blocks.get(request.request_id, 0)

    def _admission_blocks(self, num_prompt_tokens: int) -> int:
        return blocks_for(num_prompt_tokens + self.legacy.dec_blocks * self.config.block_size, self.config.block_size)

    # ------------------------------------------------------------------ hooks of Scheduler

    def _admit_waiting(self, budget: int, scheduled: dict, new_block_ids: dict, now: float) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            needed = self._admission_blocks(request.num_prompt_tokens)
            if self.prefill_used + needed > self.prefill_capacity:
                break  # first come, first served: the head waits and so does everyone behind it
            blocks = self.pool.allocate(needed)
            if blocks is None:
                break  # the quota allows it, but blocks of ended requests are still in flight
            self.waiting.popleft()
            request.block_ids = blocks
            self.prefill_used += needed
            self._prefill_blocks[request.request_id] = needed
            self.stats.num_prompt_tokens += request.num_tokens
            request.status = RequestStatus.RUNNING
            request.admitted_seq = self._admissions
            self._admissions += 1
            self.running[request] = None
            num_new = min(request.num_tokens, budget)
            scheduled[request] = num_new
            new_block_ids[request] = list(request.block_ids)
            budget -= num_new
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return budget

    def _grow(self, request: Request, num_new: int) -> list[int] | None:
        needed = blocks_for(request.num_computed_tokens + num_new, self.config.block_size) - len(request.block_ids)
        if needed <= 0:
            return []
        if self.decode_used + needed > self.decode_capacity:
            return None
        blocks = self.pool.allocate(needed)
        if blocks is None:
            return None  # blocks of ended requests are still in flight
        self.decode_used += needed
        request.block_ids.extend(blocks)
        return blocks

    def _choose_victim(self, requester: Request) -> Request:
        candidates = [r for r in self.running if r.status is RequestStatus.RUNNING]
        victim = max(candidates, key=self.decode_blocks)
        return victim if self.decode_blocks(victim) > 0 else requester

    def _preempt(self, request: Request, now: float, outcome: StepOutcome) -> None:
        """Suspend: give back the decode blocks, keep the prompt blocks and the batch slot."""
        num_prefill = self._prefill_blocks[request.request_id]
        decode_blocks = request.block_ids[num_prefill:]
        if not decode_blocks or self.legacy.disable_recover:
            # Nothing to give back means this request alone needs more than the decode table.
            self._end_incomplete(request, INCOMPLETE if decode_blocks else TOO_LONG, now, outcome)
            return
        self._release(request, decode_blocks)
        self.decode_used -= len(decode_blocks)
        del request.block_ids[num_prefill:]
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.status = RequestStatus.SUSPENDED
        request.sent_to_worker = False
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.num_preempted_waiting += 1

    def _can_run(self, request: Request, now: float, outcome: StepOutcome) -> bool:
        """A suspended request is recovered once its whole sequence fits in the decode table."""
        if request.status is not RequestStatus.SUSPENDED:
            return request.status is RequestStatus.RUNNING
        needed = blocks_for(request.num_tokens, self.config.block_size) - len(request.block_ids)
        if needed > self.decode_capacity:
            self._end_incomplete(request, TOO_LONG, now, outcome)
            return False
        if self.decode_used + needed > self.decode_capacity:
            return False
        blocks = self.pool.allocate(needed)
        if blocks is None:
            return False  # blocks of ended requests are still in flight
        request.block_ids.extend(blocks)
        self.decode_used += needed
        request.status = RequestStatus.RUNNING
        self.num_preempted_waiting -= 1
        return True

    def _end_incomplete(self, request: Request, reason: str, now: float, outcome: StepOutcome) -> None:
        self.num_preempted_waiting -= request.status is RequestStatus.SUSPENDED
        self._end(request, FinishReason.ERROR, reason, now, outcome)

    def _finish(self, request: Request, reason: FinishReason, now: float, outcome: StepOutcome) -> None:
        num_prefill = self._prefill_blocks.pop(request.request_id, 0)
        self.prefill_used -= num_prefill
        self.decode_used -= len(request.block_ids) - num_prefill
        super()._finish(request, reason, now, outcome)


def build_scheduler(
    config: SchedulerConfig, legacy: LegacyConfig | None, stats: SchedulerStats | None = None
) -> Scheduler:
    """The unified scheduler, or the legacy split-table one when `legacy` is given."""
    return Scheduler(config, stats) if legacy is None else LegacyScheduler(config, legacy, stats)


def legacy_config_from(settings) -> LegacyConfig | None:
    """The legacy configuration when `ENABLE_V1_KVCACHE_SCHEDULER=0`, else None."""
    if settings.enable_v1_kvcache_scheduler:
        return None
    return LegacyConfig(settings.kv_cache_ratio, settings.legacy_dec_blocks, settings.legacy_disable_recover)
