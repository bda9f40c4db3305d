"""The unified-table scheduler: a pure, synchronous object that decides every step.

`schedule(now)` hands the token budget to running requests first (a decode is one token, an
unfinished chunked prefill continues), then admits waiting ones; `update(result, now)` takes
the sampled tokens and returns what each request produced. No sockets, no clocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from service import wire
from service.scheduler.admission import AdmissionReserve
from service.scheduler.block_pool import BlockPool
from service.scheduler.outputs import closing_delta, new_request_message, stop_reason, token_delta
from service.scheduler.policies import POLICIES
from service.scheduler.request import FinishReason, Request, RequestStatus
from service.scheduler.stats import SchedulerStats


class RequestRejected(ValueError):
    """A request that could never be served; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


DEFAULT_MAX_MODEL_LEN = 8192  # for the simulator, which has no model to ask


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    preemption_policy: str = "min_recompute"
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # prompt token ids must lie below it (None: not checked)
    max_skip_ahead: int = 8  # waiting requests looked at past a head that does not fit
    max_head_skips: int = 32  # admission rounds a head may be passed over before it blocks others

    @classmethod
    def from_settings(cls, settings, num_blocks: int, **overrides) -> "SchedulerConfig":
        """The scheduling settings of `settings` for a table of `num_blocks` (overrides win)."""
        values = dict(
            num_blocks=num_blocks,
            block_size=settings.block_size,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.max_model_len or DEFAULT_MAX_MODEL_LEN,
            enable_prefix_caching=settings.enable_prefix_caching,
            preemption_policy=settings.preemption_policy,
        )
        values.update(overrides)
        return cls(**values)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    """Owns the block table, the queues and every request's progress."""

    def __init__(self, config: SchedulerConfig, stats: SchedulerStats | None = None):
        self.config = config
        self.pool = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.choose_victim = POLICIES[config.preemption_policy]
        self.reserve = AdmissionReserve()
        self.stats = stats or SchedulerStats()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preempted_waiting = 0
        self.finished: list[Request] = []  # since the last schedule(); see pop_finished()
        self._step_id = 0
        self._admissions = 0
        self._finished_for_worker: list[str] = []
        self._last_scheduled: list[Request] = []
        self._pending_deltas: list[wire.RequestDelta] = []  # requests ended inside schedule()

    def pool_usage(self) -> list[tuple[str, int, int]]:
        """(pool, capacity, used blocks) of each table: one here; the legacy mode has two."""
        return [("unified", self.pool.num_blocks, self.pool.num_blocks - self.pool.num_free_blocks)]

    @property
    def has_work(self) -> bool:
        """Requests to serve, or finished ones the worker has not been told about."""
        return bool(self.requests or self._finished_for_worker)

    def take_ended_deltas(self) -> list[wire.RequestDelta]:
        """Closing deltas of requests that schedule() itself ended (legacy: incomplete); send them now."""
        deltas, self._pending_deltas = self._pending_deltas, []
        return deltas

    def pop_finished(self) -> list[Request]:
        """Requests finished since the last call (kept until the next schedule() at most)."""
        finished, self.finished = self.finished, []
        return finished

    # ------------------------------------------------------------------ requests in

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: wire.SamplingParams, now: float
    ) -> None:
        """Queue a request, or raise RequestRejected if it could never be served."""
        cfg = self.config
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", status=409)
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        if cfg.vocab_size is not None and not all(0 <= token_id < cfg.vocab_size for token_id in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must lie in [0, {cfg.vocab_size})")
        if sampling.max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1")
        if len(prompt_token_ids) >= cfg.max_model_len:
            raise RequestRejected(
                f"the prompt has {len(prompt_token_ids)} tokens; the maximum context length "
                f"(max_model_len) is {cfg.max_model_len}, prompt plus at least one output token"
            )
        max_len = min(len(prompt_token_ids) + sampling.max_tokens, cfg.max_model_len)
        needed_blocks = blocks_for(max_len - 1, cfg.block_size)
        if needed_blocks > cfg.num_blocks:
            raise RequestRejected(
                f"the request needs up to {needed_blocks} KV-cache blocks "
                f"({max_len} tokens) but the whole cache holds {cfg.num_blocks}"
            )
        request = Request(request_id, list(prompt_token_ids), sampling, now, cfg.block_size)
        self.requests[request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> wire.RequestDelta | None:
        """Stop a request wherever it is; its blocks are freed at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status in (RequestStatus.RUNNING, RequestStatus.SUSPENDED):
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.num_preempted_waiting -= request.status in (RequestStatus.PREEMPTED, RequestStatus.SUSPENDED)
        return self._end(request, FinishReason.ABORT)

    def fail_all(self, message: str) -> list[wire.RequestDelta]:
        """End every request with an error (the worker died)."""
        deltas = self.take_ended_deltas()
        deltas += [self._end(r, FinishReason.ERROR, message) for r in list(self.requests.values())]
        self.running.clear()
        self.waiting.clear()
        self.num_preempted_waiting = 0
        self._last_scheduled = []
        return deltas

    # ------------------------------------------------------------------ one step

    def schedule(self, now: float) -> wire.SchedulerOutput:
        """Decide what the worker computes in the next step."""
        self.finished = []
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        new_block_ids: dict[Request, list[int]] = {}
        preempted: list[Request] = []

        for request in list(self.running):
            if budget == 0:
                break
            if not self._can_run(request):
                continue  # preempted earlier in this step, or suspended
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while (blocks := self._grow(request, num_new)) is None:
                victim = self._choose_victim(request)
                budget += scheduled.pop(victim, 0)
                new_block_ids.pop(victim, None)
                self._preempt(victim)
                if not victim.is_finished:
                    preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                scheduled[request] = num_new
                new_block_ids[request] = blocks
                budget -= num_new

        if preempted:
            self.reserve.on_preemption()
        else:
            budget = self._admit_waiting(budget, scheduled, new_block_ids, now)
        if scheduled:
            self.reserve.on_step()
        return self._build_output(scheduled, new_block_ids, preempted, now)

    def update(self, result: wire.StepResult, now: float) -> list[wire.RequestDelta]:
        """Apply the worker's sampled tokens; return each request's new tokens."""
        last_scheduled, self._last_scheduled = self._last_scheduled, []
        deltas = self.take_ended_deltas()
        if result.error is not None:
            return deltas + [
                self._end(r, FinishReason.ERROR, f"worker error: {result.error}")
                for r in last_scheduled
                if not r.is_finished
            ]
        sampled = {s.request_id: s for s in result.sampled}
        for request in last_scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            self._cache_computed_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that did not reach the end: nothing sampled
            token = sampled.get(request.request_id)
            if token is None:
                deltas.append(self._end(request, FinishReason.ERROR, "the worker returned no token"))
                continue
            deltas.append(self._accept_token(request, token, now))
        self.running = [r for r in self.running if not r.is_finished]
        return deltas

    # ------------------------------------------------------------------ internals

    def _grow(self, request: Request, num_new: int) -> list[int] | None:
        """Blocks so that `num_new` more tokens fit, or None if the pool is short."""
        needed = blocks_for(request.num_computed_tokens + num_new, self.config.block_size) - len(request.block_ids)
        if needed <= 0:
            return []
        blocks = self.pool.allocate(needed)
        if blocks is not None:
            request.block_ids.extend(blocks)
        return blocks

    def _can_run(self, request: Request) -> bool:
        return request.status is RequestStatus.RUNNING

    def _choose_victim(self, requester: Request) -> Request:
        # The longest-running request is never offered, so one request always progresses.
        return self.choose_victim(self.running[1:] or [requester], self.pool)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0
        request.status = RequestStatus.PREEMPTED
        self.num_preempted_waiting += 1
        request.num_preemptions += 1
        request.sent_to_worker = False
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, budget: int, scheduled: dict, new_block_ids: dict, now: float) -> int:
        cfg = self.config
        reserved = self.reserve.reserved_blocks(self.running, cfg.max_model_len, cfg.block_size)
        passed: list[Request] = []
        while (
            self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and len(passed) <= cfg.max_skip_ahead
        ):
            request = self.waiting.popleft()
            num_new = self._try_admit(request, budget, reserved)
            if num_new is None:
                request.num_skipped += not passed
                passed.append(request)
                if request.num_skipped > cfg.max_head_skips:
                    break  # aged head: nobody passes it any more, blocks drain to it
                continue
            reserved += self.reserve.reserved_blocks([request], cfg.max_model_len, cfg.block_size)
            scheduled[request] = num_new
            new_block_ids[request] = list(request.block_ids)
            budget -= num_new
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        self.waiting.extendleft(reversed(passed))
        return budget

    def _try_admit(self, request: Request, budget: int, reserved_blocks: int) -> int | None:
        """Admit if the whole remaining prompt fits beside the reserve; return tokens to compute now."""
        size = self.config.block_size
        cached = self.pool.find_cached_prefix(request.block_hashes, request.token_ids, (request.num_tokens - 1) // size)
        cached_free = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        needed = blocks_for(request.num_tokens, size) - len(cached)
        if needed + reserved_blocks > self.pool.num_free_blocks - cached_free:
            return None
        self.pool.touch(cached)
        num_cached_tokens = len(cached) * size
        num_new = min(request.num_tokens - num_cached_tokens, budget)
        request.block_ids = list(cached)
        request.num_cached_blocks = len(cached)
        request.num_computed_tokens = num_cached_tokens
        self._grow(request, num_new)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached_tokens
            self.stats.num_prompt_tokens += request.num_tokens
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += num_cached_tokens
        else:
            self.num_preempted_waiting -= 1
        request.status = RequestStatus.RUNNING
        request.num_skipped = 0
        request.admitted_seq = self._admissions
        self._admissions += 1
        self.running.append(request)
        return num_new

    def _build_output(self, scheduled: dict, new_block_ids: dict, preempted: list, now: float) -> wire.SchedulerOutput:
        new_requests, running_requests = [], []
        for request, num_new in scheduled.items():
            if request.sent_to_worker:
                running_requests.append(wire.RunningRequest(request.request_id, new_block_ids[request], num_new))
            else:
                new_requests.append(new_request_message(request, num_new))
                request.sent_to_worker = True
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            self.stats.num_recomputed_tokens += max(0, min(end, request.max_computed_tokens) - start)
            request.max_computed_tokens = max(request.max_computed_tokens, end)
            request.num_computed_tokens = end
        self._last_scheduled = list(scheduled)
        self._step_id += 1
        finished, self._finished_for_worker = self._finished_for_worker, []
        return wire.SchedulerOutput(
            step_id=self._step_id,
            new_requests=new_requests,
            running_requests=running_requests,
            finished_request_ids=finished,
            preempted_request_ids=[r.request_id for r in preempted],
        )

    def _cache_computed_blocks(self, request: Request) -> None:
        num_full = min(request.num_computed_tokens // self.config.block_size, len(request.block_hashes))
        self.pool.cache_blocks(
            request.block_ids, request.block_hashes, request.token_ids, request.num_cached_blocks, num_full
        )
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def _accept_token(self, request: Request, token: wire.SampledToken, now: float) -> wire.RequestDelta:
        request.append_token(token.token_id)
        self.stats.num_generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
        reason = stop_reason(request, token.token_id, self.config.eos_token_ids, self.config.max_model_len)
        if reason is not None:
            self._finish(request, reason)
        return token_delta(request, token, reason)

    def _end(self, request: Request, reason: FinishReason, error: str | None = None) -> wire.RequestDelta:
        """Finish a request and return its closing delta."""
        self._finish(request, reason)
        return closing_delta(request, reason, error)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []
        if request.sent_to_worker:
            self._finished_for_worker.append(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self.stats.record_finish(request)
        self.finished.append(request)
