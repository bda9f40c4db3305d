"""The scheduler: a pure, synchronous object that decides every step.

`schedule(now)` gives the token budget to running requests first (a decode is one token, an
unfinished chunked prefill continues), then admits waiting ones; `update(step, result, now)`
takes the sampled tokens and returns what the step produced. No sockets, no clocks. It knows
requests, not blocks: those come from its KV-cache manager; its admission and preemption
strategies say who gets in and who gives blocks back (`build_scheduler`: unified or split table).

Steps may overlap (engine.py): a decoding request then gets one more token whose input is the
token the step in flight samples (the worker fills it in). A request that ends while a step in
flight computes it has that token discarded (a wasted decode slot, counted).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace
from operator import attrgetter

from service.contract import wire
from service.contract.limits import (
    priority_problem,
    prompt_problem,
    request_id_problem,
    sampling_problem,
    tenant_problem,
)
from service.contract.wire import DEFAULT_TENANT
from service.scheduler import split_table as split
from service.scheduler.admission import Admitted, ReserveAdmission
from service.scheduler.counters import SchedulerCounters
from service.scheduler.fair_share import FairShare
from service.scheduler.kv_cache_manager import KVCacheManager
from service.scheduler.messages import closing_delta, new_request_message, stop_token_ids, token_delta
from service.scheduler.outcome import StepOutcome
from service.scheduler.preemption import RecomputePreemption, importance
from service.scheduler.request import FinishReason, Request, RequestStatus
from service.scheduler.step_cost import StepCostModel
from service.scheduler.waiting_queue import FairWaitingQueue, PriorityWaitingQueue, priority_key

log = logging.getLogger(__name__)

_num_computed_tokens = attrgetter("num_computed_tokens")
COLD_CHUNK_TOKENS = 128  # a prompt chunk before any step was timed: small enough to cost little anywhere


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
    scheduling_policy: str = (
        "fcfs"  # fcfs; priority: by (priority, arrival) with aging; fair: by tenant (fair_share.py)
    )
    priority_aging_s: float = 60.0  # priority: a request of priority p is served as if it arrived p x this later
    fair_prompt_token_cost: float = 1.0  # fair: what a prompt token adds to its tenant's counter (times 1/weight)
    fair_output_token_cost: float = 2.0  # fair: what an output token adds
    tenant_max_running: int = 0  # requests of one tenant running at once (0: no limit)
    tenant_max_queued: int = 0  # requests of one tenant waiting at once; beyond, refused with 429 (0: no limit)
    target_itl_s: float | None = None  # prefill chunks sized so a step with decodes takes about this long

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
            scheduling_policy=settings.scheduling_policy,
            priority_aging_s=settings.priority_aging_s,
            fair_prompt_token_cost=settings.fair_prompt_token_cost,
            fair_output_token_cost=settings.fair_output_token_cost,
            tenant_max_running=settings.tenant_max_running,
            tenant_max_queued=settings.tenant_max_queued,
            target_itl_s=settings.target_itl_ms / 1000 if settings.target_itl_ms else None,
        )
        values.update(overrides)
        return cls(**values)


@dataclass(slots=True)
class ScheduledStep:
    """One step: the message for the worker, what scheduling itself ended, and what update() needs."""

    output: wire.SchedulerOutput
    outcome: StepOutcome  # requests that schedule() ended (split table: incomplete)
    requests: list[Request] = field(default_factory=list)  # scheduled, in the order of the message's requests
    not_sampling: set[Request] = field(default_factory=set)  # prompt chunks short of the end: nothing sampled
    filled: list[tuple[Request, int]] = field(default_factory=list)  # (request, computed tokens) filling a block
    cost_terms: tuple[int, int, int] = (0, 0, 0)  # requests, tokens, cached tokens they read (see step_cost.py)
    schedule_s: float = 0.0  # how long schedule() took (the engine loop times it, for the metrics)

    @property
    def step_id(self) -> int:
        return self.output.step_id

    @property
    def needs_result(self) -> bool:
        return not self.output.is_empty


class Scheduler:
    """Owns the queues and every request's progress; asks its KV-cache manager for blocks."""

    def __init__(self, config: SchedulerConfig, kv, admission, preemption, counters: SchedulerCounters | None = None):
        self.config = config
        self.kv = kv
        self.admission = admission
        self.preemption = preemption
        self.counters = counters or SchedulerCounters()
        self.requests: dict[str, Request] = {}
        self.by_priority = config.scheduling_policy in ("priority", "fair")  # fair orders by priority within a tenant
        self.fair = config.scheduling_policy == "fair"
        self.fair_share = FairShare(config.fair_prompt_token_cost, config.fair_output_token_cost)
        if self.fair:
            self.waiting = FairWaitingQueue(self.fair_share, config.priority_aging_s, config.tenant_max_running)
        else:
            self.waiting = PriorityWaitingQueue(config.priority_aging_s) if self.by_priority else deque()
        self.step_cost = StepCostModel()
        self.prefill_budget = config.max_num_batched_tokens  # prompt tokens the latest step could take
        self._load = (0, 0, 0)  # the latest step's decodes, the cached tokens they read, its prompts' context
        self.running: dict[Request, None] = {}  # in admission order (an ordered set)
        self.num_preempted_waiting = 0  # requests in `waiting` that ran before
        self._step_id = 0
        self._admissions = 0
        self._finished_for_worker: list[str] = []
        self._voided_until: dict[Request, int] = {}  # preempted request -> last step in which its part is void

    @property
    def has_work(self) -> bool:
        """Requests to serve, or finished ones the worker has not been told about."""
        return bool(self.requests or self._finished_for_worker)

    # ------------------------------------------------------------------ requests in

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling,
        now: float,
        owner=b"",
        priority: int = 0,
        tenant: str = DEFAULT_TENANT,
        tenant_weight: float = 1.0,
    ) -> None:
        """Queue a request, or raise RequestRejected if it could never be served (or, 429, if its tenant
        has its most requests queued)."""
        cfg = self.config
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", status=409)
        max_len = min(len(prompt_token_ids) + sampling.max_tokens, cfg.max_model_len)
        if problem := (
            prompt_problem(prompt_token_ids, cfg.vocab_size, cfg.max_model_len)
            or request_id_problem(request_id)
            or sampling_problem(sampling, cfg.vocab_size)
            or priority_problem(priority)
            or tenant_problem(tenant, tenant_weight)
            or self.kv.admission_problem(len(prompt_token_ids), max_len)
        ):
            raise RequestRejected(problem)
        owner_tenant = self.fair_share.tenant(tenant, tenant_weight)
        if cfg.tenant_max_queued and owner_tenant.num_waiting >= cfg.tenant_max_queued:
            raise RequestRejected(
                f"too many requests of this tenant are queued ({cfg.tenant_max_queued}, "
                "BLOCKSERVE_TENANT_MAX_QUEUED): retry later",
                status=429,
            )
        if not owner_tenant.is_active:
            self.fair_share.lift(owner_tenant)
        stops = stop_token_ids(sampling, cfg.eos_token_ids)
        priority = priority if self.by_priority else 0  # fcfs ignores the field, as vLLM does
        request = Request(
            request_id, list(prompt_token_ids), sampling, now, owner, stops, max_len, priority, owner_tenant
        )
        self.requests[request_id] = request
        owner_tenant.num_waiting += 1
        self.waiting.append(request)

    def abort_request(self, request_id: str, now: float) -> StepOutcome:
        """Stop a request wherever it is; its blocks are freed."""
        outcome = StepOutcome()
        request = self.requests.get(request_id)
        if request is None:
            return outcome
        if request.status is not RequestStatus.RUNNING:
            self.waiting.remove(request)
            request.tenant.num_waiting -= 1
            self.num_preempted_waiting -= request.status is RequestStatus.PREEMPTED
        self._end(request, FinishReason.ABORT, None, now, outcome)
        return outcome

    def fail_all(self, message: str, now: float, error_status: int = 503) -> StepOutcome:
        """End every request with an error (the worker is gone: no step in flight will return)."""
        outcome = StepOutcome()
        for request in list(self.requests.values()):
            if request.status is not RequestStatus.RUNNING:
                request.tenant.num_waiting -= 1
            self._end(request, FinishReason.ERROR, message, now, outcome, error_status)
        self.waiting.clear()
        self.num_preempted_waiting = 0
        return outcome

    # ------------------------------------------------------------------ one step

    def schedule(self, now: float) -> ScheduledStep:
        """Decide what the worker computes in the next step."""
        outcome = StepOutcome()  # requests that scheduling itself ends (split table: incomplete)
        budget = self.config.max_num_batched_tokens
        prefill_budget = self.prefill_budget = self._prefill_budget()
        chunk_budget = prefill_budget
        if self.waiting and prefill_budget < budget:  # time-limited: running prompts leave waiting ones room
            chunk_budget = max(1, prefill_budget // 2)
        num_slots = self.kv.num_slots
        running_status = RequestStatus.RUNNING
        decodes: list[Request] = []  # one token into blocks they hold: the common case
        chunks: dict[Request, int] = {}  # the others: tokens to compute
        new_block_ids: dict[Request, list[int]] = {}
        preempted: list[Request] = []

        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not running_status:
                continue  # preempted or ended earlier in this step
            pending = request.num_output_placeholders
            num_known = len(request.token_ids)
            if pending and num_known + pending >= request.max_num_tokens:
                continue  # the tokens in flight end it: nothing more to compute
            computed = request.num_computed_tokens
            num_new = num_known + pending - computed
            if num_new > budget:
                num_new = budget
            if num_new > 1:  # a prompt chunk (or a recompute): within the step's time
                num_new = min(num_new, chunk_budget)
                if num_new == 0:
                    continue
                chunk_budget -= num_new
                prefill_budget -= num_new
            if computed + num_new <= num_slots[request]:
                if num_new == 1:
                    decodes.append(request)
                else:
                    chunks[request] = num_new
                budget -= num_new
                continue
            while (block_ids := self.kv.allocate_slots(request, computed + num_new)) is None:
                victim = self.preemption.choose_victim(request, list(self.running))
                if victim is None or (victim is request and request.num_output_placeholders):
                    break  # it waits (its next token is still computing: decide once it is known)
                num_decode, num_chunk = _unschedule(victim, decodes, chunks, new_block_ids)
                budget += num_decode + num_chunk
                prefill_budget, chunk_budget = prefill_budget + num_chunk, chunk_budget + num_chunk
                self._preempt(victim, now, outcome)
                if not victim.is_finished:
                    preempted.append(victim)
                if victim is request:
                    break
            if block_ids is not None:
                chunks[request] = num_new
                new_block_ids[request] = block_ids
                budget -= num_new
            elif num_new > 1:
                chunk_budget += num_new
                prefill_budget += num_new

        if preempted:
            self.admission.on_preemption()
        elif self.waiting and budget > 0 and prefill_budget > 0:
            victim_for = self._victim_for_a_fair_share if self.fair else self._victim_for_a_better_priority
            while self.by_priority and (victim := victim_for()) is not None:
                num_decode, num_chunk = _unschedule(victim, decodes, chunks, new_block_ids)
                budget, prefill_budget = budget + num_decode + num_chunk, prefill_budget + num_chunk
                self._preempt(victim, now, outcome)
                preempted.append(victim)
            # What gave way made room for better priorities only (fair: for a tenant below its share, whom
            # the queue serves first; the tenants that gave way are over theirs and admit nothing this step).
            priority_below = float("inf") if self.fair else min((r.priority for r in preempted), default=float("inf"))
            gave_way = frozenset(r.tenant for r in preempted) if self.fair else frozenset()
            if len(self.running) < self.config.max_num_seqs:
                seats = self.config.max_num_seqs - len(self.running)
                budget_now = min(budget, prefill_budget)
                admitting = self.admission.admit(self.waiting, budget_now, seats, priority_below, gave_way)
                for admitted in admitting:
                    self._admit(admitted, now)
                    chunks[admitted.request] = admitted.num_new_tokens
                    new_block_ids[admitted.request] = admitted.block_ids
        if chunks or decodes:
            self.admission.on_step()
        return self._build_step(chunks, new_block_ids, decodes, preempted, outcome)

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may compute: the token budget, or, with a latency target, no more than
        the learned step cost lets in beside the decodes (at least a block's worth, so prompts move).
        Without decodes the whole target goes to prompts, but no more: a request that arrives meanwhile
        waits for at most one such step, never for a token budget's worth (seconds on a small CPU)."""
        budget, target = self.config.max_num_batched_tokens, self.config.target_itl_s
        if target is None:
            return budget
        if not self.step_cost.num_observations:  # a cold start: time a small chunk first
            return min(budget, max(self.config.block_size, COLD_CHUNK_TOKENS))
        try:
            fitting = self.step_cost.prefill_tokens_within(target, *self._load)
        except Exception:
            self._step_cost_failed("sizing a prompt chunk")
            return self.prefill_budget  # the latest step's: the best the model said
        return min(budget, max(self.config.block_size, fitting))

    def _learn_step_cost(self, cost_terms: tuple[int, int, int], seconds: float) -> None:
        try:
            self.step_cost.observe(*cost_terms, seconds)
        except Exception:
            self._step_cost_failed("learning from a step")

    def _step_cost_failed(self, doing: str) -> None:
        """The step cost only sizes prompt chunks: its failure is counted and logged, never a stop."""
        self.counters.num_step_cost_errors += 1
        log.exception("the step cost model failed %s; scheduling goes on", doing)

    def _victim_for_a_better_priority(self) -> Request | None:
        """A running request that gives way to the best waiting request, which lacks a seat or blocks:
        of a lower priority, and not aged past it (the queue would serve the waiting one first). None if
        it lacks nothing, or if all that may give way would not make room."""
        head, aging_s = self.waiting.peek(), self.config.priority_aging_s
        if len(self.running) < self.config.max_num_seqs and self.admission.fits(head):
            return None
        key = priority_key(head, aging_s)
        yielding = [r for r in self.running if r.priority > head.priority and key < priority_key(r, aging_s)]
        if not yielding or not self.admission.fits(head, sum(len(self.kv.block_ids(r)) for r in yielding)):
            return None
        return self.preemption.lowest_priority_victim(yielding)

    def _victim_for_a_fair_share(self) -> Request | None:
        """A running request that gives way to the next waiting one, whose tenant lacks a seat or blocks while
        below its weighted share of them: of the tenant furthest over its share, which keeps at least its
        share. None if the next lacks nothing, holds its share already, or giving way would not make room.
        The most important running request never gives way."""
        head, cfg, kv = self.waiting.peek(), self.config, self.kv
        if lacks_seat := len(self.running) >= cfg.max_num_seqs:
            shares = self.fair_share.shares(cfg.max_num_seqs)
            held = {tenant: tenant.num_running for tenant in shares}
            needed = 1
        elif not self.admission.fits(head):
            shares = self.fair_share.shares(kv.pool.num_blocks)
            held = dict.fromkeys(shares, 0)
            for request in self.running:
                held[request.tenant] += len(kv.block_ids(request))
            needed = -(-head.num_tokens // kv.block_size)
        else:
            return None
        owner = head.tenant
        if held[owner] + needed > shares[owner]:
            return None

        def cost(request: Request) -> int:
            return 1 if lacks_seat else len(kv.block_ids(request))

        protected = min(self.running, key=importance)
        giving = [
            r
            for r in self.running
            if r.tenant is not owner and r is not protected and held[r.tenant] > shares[r.tenant]
        ]
        if not giving:
            return None
        if not lacks_seat and not self.admission.fits(head, sum(map(cost, giving)) + self.admission.reserve_of(giving)):
            return None
        for tenant in sorted({r.tenant for r in giving}, key=lambda t: held[t] / shares[t], reverse=True):
            # Within a tenant its priorities decide, as when blocks run out; it keeps at least its share.
            victim = self.preemption.lowest_priority_victim([r for r in giving if r.tenant is tenant])
            if held[tenant] - cost(victim) >= shares[tenant]:
                return victim
        return None

    def update(self, step: ScheduledStep, result: wire.StepResult, now: float) -> StepOutcome:
        """Apply the worker's sampled tokens for `step`; return what they produced."""
        outcome = StepOutcome()
        step_id, voided = step.step_id, self._voided_until
        if result.compute_s > 0 and self.config.target_itl_s is not None:
            self._learn_step_cost(step.cost_terms, result.compute_s)
        if result.error is not None:
            for request in step.requests:
                if not request.is_finished and voided.get(request, 0) < step_id:
                    self._end(request, FinishReason.ERROR, f"worker error: {result.error}", now, outcome)
        else:
            if voided:  # preempted since: what this step computed for them is recomputed, not cached
                self.kv.cache_blocks([(r, computed) for r, computed in step.filled if voided.get(r, 0) < step_id])
            elif step.filled:  # the ended hold no blocks: nothing of theirs is cached
                self.kv.cache_blocks(step.filled)
            self._take_tokens(step, result.sampled, now, outcome, result.refused)
        if voided:
            for request in [r for r, until in voided.items() if until <= step_id]:
                del voided[request]
        outcome.cache_events = self.kv.take_cache_events()
        return outcome

    def _take_tokens(
        self, step: ScheduledStep, sampled: list, now: float, outcome: StepOutcome, refused: dict[str, str]
    ) -> None:
        """Each sampling request's token: appended, ended on a stop, and sent. A plain token (no logprobs, not
        the last) goes to its replica's columns. This loop runs per request per step: keep it lean."""
        step_id, voided, not_sampling = step.step_id, self._voided_until, step.not_sampling
        tokens = iter(sampled)  # in the order of the step's requests, those the worker could sample
        token = next(tokens, None)
        gaps, columns_of, on_token = outcome.token_gaps_s, outcome.tokens, self.kv.on_token
        finished = RequestStatus.FINISHED
        owner = request_ids = token_column = None  # the columns of the last request's replica
        for request in step.requests:
            if not_sampling and request in not_sampling:
                continue  # a prompt chunk that did not reach the end: nothing sampled
            if token is not None and token.request_id == request.request_id:
                sampled_token, token = token, next(tokens, None)
            else:
                sampled_token = None
            if voided and voided.get(request, 0) >= step_id:
                continue  # preempted since: it is recomputed from scratch
            if request.status is finished:
                self.counters.num_wasted_decode_slots += 1  # ended while this step computed its token
                continue
            request.num_output_placeholders -= 1
            if sampled_token is None:
                if (refusal := refused.get(request.request_id)) is not None:  # its own parameters: a 400
                    self._end(request, FinishReason.ERROR, f"the worker refused it: {refusal}", now, outcome, 400)
                else:
                    self._end(request, FinishReason.ERROR, "the worker returned no token", now, outcome)
                continue
            token_id, token_ids = sampled_token.token_id, request.token_ids
            token_ids.append(token_id)
            if request.last_token_time is None:
                request.first_token_time = now
                outcome.first_tokens.append(request)
            else:
                gaps.append(now - request.last_token_time)
            request.last_token_time = now
            if token_id in request.stop_token_ids or len(token_ids) >= request.max_num_tokens:
                reason = FinishReason.STOP if token_id in request.stop_token_ids else FinishReason.LENGTH
                outcome.add(request, token_delta(request, sampled_token, reason))
                self._finish(request, reason, now, outcome)
            else:
                if sampled_token.logprob is not None:
                    outcome.add(request, token_delta(request, sampled_token, None))
                else:
                    if request.owner != owner:
                        owner = request.owner
                        if (columns := columns_of.get(owner)) is None:
                            columns = columns_of[owner] = ([], [])
                        request_ids, token_column = columns
                    request_ids.append(request.request_id)
                    token_column.append(token_id)
                on_token(request)
        self.counters.num_generation_tokens += outcome.num_tokens

    # ------------------------------------------------------------------ internals

    def _admit(self, admitted: Admitted, now: float) -> None:
        request = admitted.request
        request.num_computed_tokens = admitted.num_cached_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = admitted.num_cached_tokens
            self.counters.num_prompt_tokens += request.num_tokens
            self.counters.of_tenant(request.tenant.name).prompt_tokens += request.num_tokens
            self.counters.prefix_cache_queries += request.num_tokens
            self.counters.prefix_cache_hits += admitted.num_cached_tokens
        else:
            self.num_preempted_waiting -= 1
        tenant = request.tenant
        tenant.num_waiting -= 1
        tenant.num_running += 1
        if self.fair:
            self.waiting.ran(request)
        request.status = RequestStatus.RUNNING
        request.num_skipped = 0
        request.admitted_seq = self._admissions
        self._admissions += 1
        self.running[request] = None
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now

    def _preempt(self, victim: Request, now: float, outcome: StepOutcome) -> None:
        if (reason := self.preemption.preempt(victim)) is not None:
            self._end(victim, FinishReason.ERROR, reason, now, outcome)
            return
        self._voided_until[victim] = self._step_id  # what steps in flight compute for it is recomputed
        victim.max_computed_tokens = max(victim.max_computed_tokens, victim.num_computed_tokens)
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0
        victim.sent_to_worker = False
        victim.num_preemptions += 1
        self.counters.of_tenant(victim.tenant.name).preemptions += 1
        self.counters.num_preemptions += 1
        if self.preemption.requeues_victims:
            del self.running[victim]
            victim.tenant.num_running -= 1
            victim.tenant.num_waiting += 1
            victim.status = RequestStatus.PREEMPTED
            self.num_preempted_waiting += 1
            self.waiting.appendleft(victim)

    def _build_step(
        self, chunks: dict, new_block_ids: dict, decodes: list, preempted: list, outcome: StepOutcome
    ) -> ScheduledStep:
        """The step's message and what update() needs. Runs per request per step: keep it lean."""
        self._step_id += 1
        block_size = self.config.block_size
        step = ScheduledStep(wire.SchedulerOutput(step_id=self._step_id), outcome)
        new_requests, running_requests, requests_new, requests_running = [], [], [], []
        counts_new, counts_running = [], []
        chunk_tokens = chunk_attended = single_tokens = single_attended = 0  # for the step cost (step_cost.py)
        for request, num_new in chunks.items():
            if num_new == 1:  # a decode that gained a block: one token, as `decodes`
                single_tokens += 1
                single_attended += request.num_computed_tokens + 1
            else:
                chunk_tokens += num_new
                chunk_attended += num_new * (request.num_computed_tokens + num_new)
            if not request.sent_to_worker:
                new_requests.append(new_request_message(request, self.kv.block_ids(request), num_new))
                request.sent_to_worker = True
                requests_new.append(request)
                counts_new.append(num_new)
            else:
                running_requests.append(
                    wire.RunningRequest(request.request_id, new_block_ids.get(request, []), num_new)
                )
                requests_running.append(request)
                counts_running.append(num_new)
        for request in decodes:  # one token into blocks it holds: the same message every time
            if (message := request.decode_message) is None:
                message = request.decode_message = wire.RunningRequest(request.request_id, [], 1)
            running_requests.append(message)
        step.requests = requests = requests_new + requests_running + decodes  # the worker samples in this order
        recomputed, not_sampling, filled = 0, step.not_sampling, step.filled
        for request, num_new in zip(requests, counts_new + counts_running + [1] * len(decodes)):
            start = request.num_computed_tokens
            end = request.num_computed_tokens = start + num_new
            if start < request.max_computed_tokens:
                recomputed += min(end, request.max_computed_tokens) - start
            if end == len(request.token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1
            else:
                not_sampling.add(request)
            if end // block_size > start // block_size:
                filled.append((request, end))
        self.counters.num_recomputed_tokens += recomputed
        if self.fair:
            self._charge_output(requests, not_sampling)
        if self.config.target_itl_s is not None:  # what the step cost model learns from and predicts with
            decode_attended = single_attended + sum(map(_num_computed_tokens, decodes))
            num_decodes = single_tokens + len(decodes)
            step.cost_terms = (len(requests), chunk_tokens + num_decodes, chunk_attended + decode_attended)
            self._load = (num_decodes, decode_attended, chunk_attended // chunk_tokens if chunk_tokens else 0)
        finished, self._finished_for_worker = self._finished_for_worker, []
        output = step.output
        output.new_requests, output.running_requests = new_requests, running_requests
        output.finished_request_ids = finished
        output.preempted_request_ids = [r.request_id for r in preempted]
        output.reset = self._step_id == 1  # a new scheduler knows nothing the worker may still hold
        outcome.cache_events = self.kv.take_cache_events()
        return step

    def _charge_output(self, scheduled: list[Request], not_sampling: set[Request]) -> None:
        """Each request that samples in this step is given an output token: counted per tenant from its running
        requests, less the few that do not sample or were not scheduled (not per request: this runs every step)."""
        charge = self.fair_share.charge_output
        for tenant in self.fair_share.active():
            if tenant.num_running:
                charge(tenant, tenant.num_running)
        for request in not_sampling:
            charge(request.tenant, -1)
        if len(scheduled) < len(self.running):
            scheduled_now = set(scheduled)
            for request in self.running:
                if request not in scheduled_now:
                    charge(request.tenant, -1)

    def _end(self, request: Request, reason, error: str | None, now, outcome: StepOutcome, error_status=500) -> None:
        """Finish a request and give its api replica the closing delta."""
        outcome.add(request, closing_delta(request, reason, error, error_status))
        self._finish(request, reason, now, outcome)

    def _finish(self, request: Request, reason: FinishReason, now: float, outcome: StepOutcome) -> None:
        if self.running.pop(request, False) is None:  # it was running (the dict holds None for each)
            request.tenant.num_running -= 1
        self.kv.forget(request)
        if request.sent_to_worker:
            self._finished_for_worker.append(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = now
        del self.requests[request.request_id]
        self.counters.of_tenant(request.tenant.name).generation_tokens += request.num_output_tokens
        self.counters.record_finish(request)
        outcome.finished.append(request)


def _unschedule(victim: Request, decodes: list, chunks: dict, new_block_ids: dict) -> tuple[int, int]:
    """Take a preempted request out of the step being scheduled; return the tokens it had: (as a
    decode, as a chunk)."""
    new_block_ids.pop(victim, None)
    if victim in decodes:
        decodes.remove(victim)
        return 1, 0
    num_tokens = chunks.pop(victim, 0)
    return (1, 0) if num_tokens == 1 else (0, num_tokens)


def build_scheduler(
    config: SchedulerConfig,
    split_table: split.SplitTableConfig | None = None,
    counters: SchedulerCounters | None = None,
) -> Scheduler:
    """The unified-table scheduler, or the split-table baseline when `split_table` is given."""
    if split_table is None:
        kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        admission = ReserveAdmission(
            kv, config.max_skip_ahead, config.max_head_skips, tenant_max_running=config.tenant_max_running
        )
        return Scheduler(config, kv, admission, RecomputePreemption(kv, config.preemption_policy), counters)
    config = replace(config, scheduling_policy="fcfs")  # as v0: first come, first served
    kv = split.SplitTableKVCacheManager(config.num_blocks, config.block_size, split_table)
    fcfs = ReserveAdmission(kv, max_skip_ahead=0, init_ratio=0.0, min_ratio=0.0)  # no reserve: quotas decide
    return Scheduler(config, kv, fcfs, split.SuspendPreemption(kv, split_table.disable_recover), counters)
