"""Drives a Scheduler through the engine loop against the verifying FakeWorker, serial or
overlapped, and checks the invariants of its blocks, queues and reserve after every step."""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable

from service.contract import wire
from service.contract.wire import DEFAULT_TENANT
from service.scheduler.engine import EngineLoop
from service.scheduler.outcome import StepOutcome
from service.scheduler.request import RequestStatus
from service.scheduler.scheduler import ScheduledStep, SchedulerConfig, build_scheduler
from service.scheduler.split_table import SplitTableConfig, SplitTableKVCacheManager
from service.scheduler.waiting_queue import priority_key
from service.tools.fake_worker import FakeWorker, extend_prefix_hash, next_token

VOCAB_SIZE = 64
EOS_TOKEN_ID = 0


def greedy(max_tokens: int, **fields) -> wire.SamplingParams:
    """Sampling that takes the fake model's token and never stops at EOS, so a trace's lengths are exact."""
    return wire.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields)


def admitted_ids(output: wire.SchedulerOutput | None) -> list[str]:
    return [r.request_id for r in output.new_requests] if output else []


def reference_output(prompt: list[int], sampling: wire.SamplingParams, config: SchedulerConfig) -> list[int]:
    """What an undisturbed run yields: the fake model's tokens up to a stop condition."""
    tokens = list(prompt)
    prefix_hash = extend_prefix_hash(0, prompt)
    output = []
    while True:
        token_id = next_token(prefix_hash, VOCAB_SIZE)
        output.append(token_id)
        tokens.append(token_id)
        prefix_hash = extend_prefix_hash(prefix_hash, [token_id])
        if (not sampling.ignore_eos and token_id in config.eos_token_ids) or token_id in sampling.stop_token_ids:
            return output
        if len(output) >= sampling.max_tokens or len(tokens) >= config.max_model_len:
            return output


class Harness:
    """The engine loop with a worker one step behind when `overlapped`."""

    def __init__(
        self,
        config: SchedulerConfig,
        split_table: SplitTableConfig | None = None,
        overlapped: bool = False,
        step_seconds: Callable[[wire.SchedulerOutput], float] | None = None,
    ):
        self.config = config
        self.step_seconds = step_seconds  # the compute time the worker reports for a step (none if not given)
        self.scheduler = build_scheduler(config, split_table)
        self.kv = self.scheduler.kv
        self.loop = EngineLoop(self.scheduler, overlapped)
        self.worker = FakeWorker(config.num_blocks, config.block_size, VOCAB_SIZE, verify_kv=True)
        self.to_worker: deque[wire.SchedulerOutput] = deque()  # sent, not yet executed
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.cached_hashes: set[int] = set()  # the prefix cache as the outcomes' events tell it (the api's view)
        self.admitted: list[str] = []  # request ids in the order the steps admitted them (again if re-admitted)
        self.preempted: list[str] = []  # request ids in the order the steps preempted them
        self.now = 0.0
        self.steps = 0

    def add(
        self,
        request_id: str,
        prompt: list[int],
        sampling: wire.SamplingParams,
        priority: int = 0,
        tenant: str = DEFAULT_TENANT,
        tenant_weight: float = 1.0,
    ) -> None:
        self.scheduler.add_request(
            request_id, prompt, sampling, self.now, priority=priority, tenant=tenant, tenant_weight=tenant_weight
        )
        self.outputs[request_id] = []

    def abort(self, request_id: str) -> None:
        self.record(self.scheduler.abort_request(request_id, self.now))
        self.check_pool()

    def step(self) -> wire.SchedulerOutput | None:
        """Schedule as far as the loop allows, then let the worker compute its oldest step.

        Returns the first step scheduled (serial: the only one).
        """
        sent: list[wire.SchedulerOutput] = []
        self.loop.run(self.now, lambda step: sent.append(self.send(step)))
        result = None
        while self.to_worker and result is None:
            output = self.to_worker.popleft()
            executed = self.worker.execute(output)
            result = None if output.is_empty else executed
        if result is not None:
            if self.step_seconds is not None:
                result.compute_s = self.step_seconds(output)
            self.now += 1.0
            self.record(self.loop.complete(result, self.now))
        self.check_pool()
        self.steps += 1
        return sent[0] if sent else None

    def send(self, step: ScheduledStep) -> wire.SchedulerOutput:
        self.record(step.outcome)
        self.check_step(step.output)
        self.check_victims(step.output)
        self.admitted += admitted_ids(step.output)
        self.preempted += step.output.preempted_request_ids
        self.to_worker.append(step.output)
        return step.output

    def record(self, outcome: StepOutcome) -> None:
        for block_hash, cached in zip(*outcome.cache_events):
            if cached:
                self.cached_hashes.add(block_hash)
            else:
                self.cached_hashes.remove(block_hash)
        for delta in outcome.all_deltas():
            self.outputs[delta.request_id].extend(delta.token_ids)
            assert delta.request_id not in self.finish_reasons, "a delta after the request ended"
            if delta.finish_reason is not None:
                self.finish_reasons[delta.request_id] = delta.finish_reason
            if delta.error is not None:
                self.errors[delta.request_id] = delta.error
        assert {r.request_id for r in outcome.finished} <= set(self.finish_reasons)

    def run_until_idle(self, max_steps: int = 20_000) -> None:
        while self.scheduler.requests or self.loop.in_flight:
            self.step()
            assert self.steps < max_steps, "no progress: livelock or starvation"

    def check_step(self, output: wire.SchedulerOutput) -> None:
        cfg = self.config
        assert output.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(self.scheduler.running) <= cfg.max_num_seqs
        ids = [r.request_id for r in output.new_requests] + [r.request_id for r in output.running_requests]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert all(r.num_scheduled_tokens > 0 for r in output.new_requests + output.running_requests)
        self.check_pool()

    def check_victims(self, output: wire.SchedulerOutput) -> None:
        """Victims come from the lowest priority first: every request still running after a step is of a
        priority at least as good as each request that step preempted, or has waited its priority's worth
        past it (aging protects it; see waiting_queue.py), within a tenant under the fair policy. The unified
        table's rule."""
        if isinstance(self.kv, SplitTableKVCacheManager):
            return
        aging_s = self.config.priority_aging_s
        for victim_id in output.preempted_request_ids:
            victim = self.scheduler.requests[victim_id]
            for other in self.scheduler.running:
                if self.scheduler.fair and other.tenant is not victim.tenant:
                    continue  # across tenants the shares decide (fair_share.py)
                assert other.priority <= victim.priority or priority_key(other, aging_s) <= priority_key(
                    victim, aging_s
                ), f"{victim_id} gave way while {other.request_id} of a lower priority runs on"

    def check_pool(self) -> None:
        pool = self.kv.pool
        holders: Counter[int] = Counter()
        for request in self.scheduler.requests.values():
            block_ids = self.kv.block_ids(request)
            if request.status is RequestStatus.RUNNING:
                assert len(set(block_ids)) == len(block_ids)
                holders.update(block_ids)
            else:
                assert block_ids == [], "a waiting request holds blocks"
        self.check_reserve()
        for block in pool.blocks:
            assert block.ref_count == holders[block.block_id], f"block {block.block_id} ref count is off"
            if holders[block.block_id] > 1:
                assert block.block_hash is not None, "a block shared by live requests is not a cached prefix"
        preempted = sum(1 for r in self.scheduler.waiting if r.status is RequestStatus.PREEMPTED)
        assert self.scheduler.num_preempted_waiting == preempted
        if isinstance(self.kv, SplitTableKVCacheManager):
            self.check_split_pools()
        assert self.cached_hashes == set(pool.cached_hashes()), "the cache events do not tell the prefix cache"
        used = sum(1 for block in pool.blocks if block.ref_count > 0)
        assert pool.num_free_blocks + used == pool.num_blocks
        assert 0 <= pool.num_cached_free <= pool.num_free_blocks

    def check_split_pools(self) -> None:
        kv = self.kv
        running = list(self.scheduler.running)
        decode = sum(kv.decode_blocks(r) for r in running)
        prefill = sum(len(kv.block_ids(r)) for r in running) - decode
        assert (kv.prefill_used, kv.decode_used) == (prefill, decode)
        assert kv.prefill_used <= kv.prefill_capacity, "the prefill table exceeded its share"
        assert kv.decode_used <= kv.decode_capacity, "the decode table exceeded its share"

    def check_reserve(self) -> None:
        """The incrementally kept admission reserve equals a recount over the running requests."""
        if isinstance(self.kv, SplitTableKVCacheManager):
            return
        owed = [self.kv.owed_blocks(r) for r in self.scheduler.running]
        assert (self.kv.owed_prompt_blocks, self.kv.owed_output_blocks) == tuple(map(sum, zip((0, 0), *owed)))
