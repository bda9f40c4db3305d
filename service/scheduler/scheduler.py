"""The unified-table scheduler: a pure, synchronous object that decides every step.

`schedule(now)` hands the token budget to running requests first (a decode is one token, an
unfinished chunked prefill continues), then admits waiting ones; `update(step, result, now)`
takes the sampled tokens and returns what the step produced. No sockets, no clocks.

Steps may overlap (see step_loop.py): a step can be scheduled while earlier ones are still
computing. A decoding request then gets one more token whose input is the token the step in
flight samples (a placeholder the worker fills from its own state). A request that ends while a
step in flight still computes it keeps its blocks until that step has returned, and the
token computed for it there is discarded (a wasted decode slot, counted).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from service import wire
from service.limits import request_id_problem, sampling_problem
from service.scheduler.admission import AdmissionReserve
from service.scheduler.block_pool import BlockPool, extend_block_hashes
from service.scheduler.outcome import StepOutcome
from service.scheduler.outputs import closing_delta, new_request_message, stop_token_ids, token_delta
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


@dataclass(slots=True)
class ScheduledStep:
    """One step: the message for the worker, what scheduling itself ended, and what it scheduled."""

    output: wire.SchedulerOutput
    outcome: StepOutcome  # requests that schedule() ended (legacy: incomplete)
    # (request, its preemption count then, computed tokens after the step, whether the step samples it)
    scheduled: list[tuple[Request, int, int, bool]] = field(default_factory=list)

    @property
    def step_id(self) -> int:
        return self.output.step_id

    @property
    def needs_result(self) -> bool:
        return not self.output.is_empty


class Scheduler:
    """Owns the block table, the queues and every request's progress."""

    def __init__(self, config: SchedulerConfig, stats: SchedulerStats | None = None):
        self.config = config
        self.pool = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.choose_victim = POLICIES[config.preemption_policy]
        self.reserve = AdmissionReserve(config.block_size)
        self.stats = stats or SchedulerStats()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, None] = {}  # in admission order (an ordered set)
        self.num_preempted_waiting = 0
        self._step_id = 0
        self._completed_step_id = 0  # steps up to this one have returned (they return in order)
        self._admissions = 0
        self._finished_for_worker: list[str] = []
        self._releases: dict[int, list[list[int]]] = {}  # step id -> blocks to free once it has returned
        self.num_releasing_blocks = 0
        self._promised: list[Request] = []  # waited for released blocks last step: served first this one

    def pool_usage(self) -> list[tuple[str, int, int]]:
        """(pool, capacity, used blocks) of each table: one here; the legacy mode has two."""
        return [("unified", self.pool.num_blocks, self.pool.num_blocks - self.pool.num_free_blocks)]

    @property
    def has_work(self) -> bool:
        """Requests to serve, or finished ones the worker has not been told about."""
        return bool(self.requests or self._finished_for_worker)

    def releasing_block_ids(self) -> list[int]:
        """Blocks of ended requests that a step in flight still writes (freed when it returns)."""
        return [block_id for lists in self._releases.values() for block_ids in lists for block_id in block_ids]

    # ------------------------------------------------------------------ requests in

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: wire.SamplingParams,
        now: float,
        owner: bytes = b"",
    ) -> None:
        """Queue a request, or raise RequestRejected if it could never be served."""
        cfg = self.config
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", status=409)
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        if cfg.vocab_size is not None and not all(0 <= token_id < cfg.vocab_size for token_id in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must lie in [0, {cfg.vocab_size})")
        if problem := request_id_problem(request_id) or sampling_problem(sampling, cfg.vocab_size):
            raise RequestRejected(problem)
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
        request = Request(
            request_id,
            list(prompt_token_ids),
            sampling,
            now,
            cfg.block_size,
            owner,
            stop_token_ids(sampling, cfg.eos_token_ids),
            max_len,
        )
        self.requests[request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str, now: float) -> StepOutcome:
        """Stop a request wherever it is; its blocks are freed once no step in flight computes it."""
        outcome = StepOutcome()
        request = self.requests.get(request_id)
        if request is None:
            return outcome
        if request.status not in (RequestStatus.RUNNING, RequestStatus.SUSPENDED):
            self.waiting.remove(request)
        self.num_preempted_waiting -= request.status in (RequestStatus.PREEMPTED, RequestStatus.SUSPENDED)
        self._end(request, FinishReason.ABORT, None, now, outcome)
        return outcome

    def fail_all(self, message: str, now: float, error_status: int = 503) -> StepOutcome:
        """End every request with an error (the worker is gone: no step in flight will return)."""
        outcome = StepOutcome()
        self._completed_step_id = self._step_id
        for block_lists in self._releases.values():
            for block_ids in block_lists:
                self.pool.free(block_ids)
        self._releases.clear()
        self.num_releasing_blocks = 0
        for request in list(self.requests.values()):
            self._end(request, FinishReason.ERROR, message, now, outcome, error_status)
        self.waiting.clear()
        self.num_preempted_waiting = 0
        self._finished_for_worker.clear()  # a new worker holds no state
        return outcome

    # ------------------------------------------------------------------ one step

    def schedule(self, now: float) -> ScheduledStep:
        """Decide what the worker computes in the next step."""
        outcome = StepOutcome()  # requests that scheduling itself ends (legacy: incomplete)
        budget = self.config.max_num_batched_tokens
        block_size = self.config.block_size
        running = RequestStatus.RUNNING
        scheduled: dict[Request, int] = {}
        new_block_ids: dict[Request, list[int]] = {}
        preempted: list[Request] = []

        promised, self._promised = self._promised, []
        for request in promised + [r for r in self.running if r not in promised] if promised else list(self.running):
            if budget == 0:
                break
            if request.status is not running and not self._can_run(request, now, outcome):
                continue  # preempted earlier in this step, or suspended
            pending = request.num_output_placeholders
            num_known = len(request.token_ids)
            if pending and num_known + pending >= request.max_num_tokens:
                continue  # the tokens in flight end it: nothing more to compute
            computed = request.num_computed_tokens
            num_new = num_known + pending - computed
            if num_new > budget:
                num_new = budget
            if computed + num_new <= len(request.block_ids) * block_size:
                scheduled[request] = num_new  # its blocks hold the new tokens: the common decode
                budget -= num_new
                continue
            while (blocks := self._grow(request, num_new)) is None:
                if self._releases_cover(request, num_new):
                    self._promised.append(request)  # blocks of ended requests come back with the step in flight
                    break
                victim = self._choose_victim(request)
                if victim is request and request.num_output_placeholders:
                    break  # its next token is still computing: decide once it is known, as a serial loop would
                budget += scheduled.pop(victim, 0)
                new_block_ids.pop(victim, None)
                self._preempt(victim, now, outcome)
                if not victim.is_finished:
                    preempted.append(victim)
                if victim is request:
                    break
            if blocks is not None and request.status is RequestStatus.RUNNING:
                scheduled[request] = num_new
                new_block_ids[request] = blocks
                budget -= num_new

        if preempted:
            self.reserve.on_preemption()
        elif self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            budget = self._admit_waiting(budget, scheduled, new_block_ids, now)
        if scheduled:
            self.reserve.on_step()
        return self._build_step(scheduled, new_block_ids, preempted, outcome)

    def update(self, step: ScheduledStep, result: wire.StepResult, now: float) -> StepOutcome:
        """Apply the worker's sampled tokens for `step`; return what they produced."""
        outcome = StepOutcome()
        self._completed_step_id = step.step_id
        if result.error is not None:
            for request, preemptions, _, _ in step.scheduled:
                if not request.is_finished and request.num_preemptions == preemptions:
                    self._end(request, FinishReason.ERROR, f"worker error: {result.error}", now, outcome)
        else:
            sampled = {token.request_id: token for token in result.sampled}
            block_size = self.config.block_size
            accept = self._accept_token
            gaps, columns_of, refresh = outcome.token_gaps_s, outcome.tokens, self.reserve.refresh_after_token
            for request, preemptions, computed_end, samples in step.scheduled:
                if request.num_preemptions != preemptions:
                    continue  # preempted since: it is recomputed from scratch
                if request.status is RequestStatus.FINISHED:
                    self.stats.num_wasted_decode_slots += samples  # ended while this step computed it
                    continue
                if computed_end // block_size > request.num_cached_blocks:
                    self._cache_computed_blocks(request, computed_end)
                if not samples:
                    continue  # a prefill chunk that did not reach the end: nothing sampled
                request.num_output_placeholders -= 1
                token = sampled.get(request.request_id)
                if token is None:
                    self._end(request, FinishReason.ERROR, "the worker returned no token", now, outcome)
                    continue
                token_id, token_ids = token.token_id, request.token_ids
                if (
                    token.logprob is not None
                    or request.last_token_time is None
                    or token_id in request.stop_token_ids
                    or len(token_ids) + 1 >= request.max_num_tokens
                ):
                    accept(request, token, now, outcome)  # with logprobs, a first or a last token
                    continue
                # What _accept_token does for a plain next token, inline: this runs per request per step.
                gaps.append(now - request.last_token_time)
                request.last_token_time = now
                token_ids.append(token_id)
                if len(token_ids) % request.block_size == 0:
                    extend_block_hashes(request.block_hashes, token_ids, request.block_size)
                columns = columns_of.get(request.owner)
                if columns is None:
                    columns_of[request.owner] = ([request.request_id], [token_id])
                else:
                    columns[0].append(request.request_id)
                    columns[1].append(token_id)
                refresh(request)
        self.stats.num_generation_tokens += outcome.num_tokens
        for block_ids in self._releases.pop(step.step_id, ()):
            self.num_releasing_blocks -= len(block_ids)
            self.pool.free(block_ids)
        return outcome

    # ------------------------------------------------------------------ internals

    def _grow(self, request: Request, num_new: int) -> list[int] | None:
        """Blocks so that `num_new` more tokens fit, or None if the pool is short."""
        needed = blocks_for(request.num_computed_tokens + num_new, self.config.block_size) - len(request.block_ids)
        if needed <= 0:
            return []
        blocks = self.pool.allocate(needed)
        if blocks is not None:
            request.block_ids.extend(blocks)
            self.reserve.refresh(request)
        return blocks

    def _releases_cover(self, request: Request, num_new: int) -> bool:
        """Whether blocks that steps in flight will give back make up what `request` lacks now."""
        if not self.num_releasing_blocks:
            return False
        needed = blocks_for(request.num_computed_tokens + num_new, self.config.block_size) - len(request.block_ids)
        free = self.pool.num_free_blocks
        return free < needed <= free + self.num_releasing_blocks

    def _can_run(self, request: Request, now: float, outcome: StepOutcome) -> bool:
        return request.status is RequestStatus.RUNNING

    def _choose_victim(self, requester: Request) -> Request:
        # The longest-running request is never offered, so one request always progresses.
        return self.choose_victim(list(self.running)[1:] or [requester], self.pool)

    def _preempt(self, request: Request, now: float, outcome: StepOutcome) -> None:
        del self.running[request]
        self.reserve.untrack(request)
        self._release(request, request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0
        request.num_output_placeholders = 0
        request.status = RequestStatus.PREEMPTED
        self.num_preempted_waiting += 1
        request.num_preemptions += 1
        request.sent_to_worker = False
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request, block_ids: list[int]) -> None:
        """Free blocks a request gave up; if a step in flight still computes it, once that step returns."""
        if not block_ids:
            return
        if request.last_step_id > self._completed_step_id:
            self._releases.setdefault(request.last_step_id, []).append(block_ids)
            self.num_releasing_blocks += len(block_ids)
        else:
            self.pool.free(block_ids)

    def _admit_waiting(self, budget: int, scheduled: dict, new_block_ids: dict, now: float) -> int:
        cfg = self.config
        reserved = self.reserve.reserved_blocks()
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
            self.reserve.track(request)
            reserved = self.reserve.reserved_blocks()
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
        self.running[request] = None
        return num_new

    def _build_step(self, scheduled: dict, new_block_ids: dict, preempted: list, outcome: StepOutcome) -> ScheduledStep:
        self._step_id += 1
        step_id = self._step_id
        new_requests, running_requests, records = [], [], []
        recomputed = 0
        for request, num_new in scheduled.items():
            blocks = new_block_ids.get(request)
            if not request.sent_to_worker:
                new_requests.append(new_request_message(request, num_new))
                request.sent_to_worker = True
            elif blocks or num_new != 1:
                running_requests.append(wire.RunningRequest(request.request_id, blocks or [], num_new))
            else:
                message = request.decode_message
                if message is None:
                    message = request.decode_message = wire.RunningRequest(request.request_id, [], 1)
                running_requests.append(message)
            start = request.num_computed_tokens
            end = start + num_new
            if start < request.max_computed_tokens:
                recomputed += min(end, request.max_computed_tokens) - start
            if end > request.max_computed_tokens:
                request.max_computed_tokens = end
            request.num_computed_tokens = end
            request.last_step_id = step_id
            samples = end == len(request.token_ids) + request.num_output_placeholders
            if samples:
                request.num_output_placeholders += 1
            records.append((request, request.num_preemptions, end, samples))
        self.stats.num_recomputed_tokens += recomputed
        finished, self._finished_for_worker = self._finished_for_worker, []
        output = wire.SchedulerOutput(
            step_id=step_id,
            new_requests=new_requests,
            running_requests=running_requests,
            finished_request_ids=finished,
            preempted_request_ids=[r.request_id for r in preempted],
        )
        return ScheduledStep(output, outcome, records)

    def _cache_computed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        num_full = min(num_computed_tokens // self.config.block_size, len(request.block_hashes))
        if num_full > request.num_cached_blocks:
            self.pool.cache_blocks(
                request.block_ids, request.block_hashes, request.token_ids, request.num_cached_blocks, num_full
            )
            request.num_cached_blocks = num_full

    def _accept_token(self, request: Request, token: wire.SampledToken, now: float, outcome: StepOutcome) -> None:
        token_id = token.token_id
        if request.last_token_time is None:
            request.first_token_time = now
            outcome.first_tokens.append(request)
        else:
            outcome.token_gaps_s.append(now - request.last_token_time)
        request.last_token_time = now
        token_ids = request.token_ids
        token_ids.append(token_id)
        if len(token_ids) % request.block_size == 0:
            extend_block_hashes(request.block_hashes, token_ids, request.block_size)
        if token_id in request.stop_token_ids:
            reason = FinishReason.STOP
        elif len(token_ids) >= request.max_num_tokens:
            reason = FinishReason.LENGTH
        else:
            reason = None
        if reason is None:
            if token.logprob is None:
                outcome.add_token(request, token_id)  # the common case: two column entries, no struct
            else:
                outcome.add(request, token_delta(request, token, reason))
            self.reserve.refresh_after_token(request)
        else:
            outcome.add(request, token_delta(request, token, reason))
            self._finish(request, reason, now, outcome)

    def _end(
        self,
        request: Request,
        reason: FinishReason,
        error: str | None,
        now: float,
        outcome: StepOutcome,
        error_status: int = 500,
    ) -> None:
        """Finish a request and give its api replica the closing delta."""
        outcome.add(request, closing_delta(request, reason, error, error_status))
        self._finish(request, reason, now, outcome)

    def _finish(self, request: Request, reason: FinishReason, now: float, outcome: StepOutcome) -> None:
        self.running.pop(request, None)
        self.reserve.untrack(request)
        self._release(request, request.block_ids)
        request.block_ids = []
        if request.sent_to_worker:
            self._finished_for_worker.append(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = now
        del self.requests[request.request_id]
        self.stats.record_finish(request)
        outcome.finished.append(request)
