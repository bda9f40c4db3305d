"""Drives a Scheduler against the verifying FakeWorker, serial or overlapped, and checks invariants every step."""

from __future__ import annotations

from collections import Counter, deque

from service import wire
from service.scheduler.fake_worker import FakeWorker, extend_prefix_hash, next_token
from service.scheduler.legacy import LegacyConfig, LegacyScheduler
from service.scheduler.outcome import StepOutcome
from service.scheduler.request import Request, RequestStatus
from service.scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from service.scheduler.step_loop import StepLoop

VOCAB_SIZE = 64
EOS_TOKEN_ID = 0


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
    """Drives the scheduler through the shared StepLoop; `overlapped` simulates a worker one step behind."""

    def __init__(self, config: SchedulerConfig, legacy: LegacyConfig | None = None, overlapped: bool = False):
        self.config = config
        self.scheduler = Scheduler(config) if legacy is None else LegacyScheduler(config, legacy)
        self.loop = StepLoop(self.scheduler, overlapped)
        self.worker = FakeWorker(config.num_blocks, config.block_size, VOCAB_SIZE, verify_kv=True)
        self.to_worker: deque[wire.SchedulerOutput] = deque()  # sent, not yet executed
        self.written: dict[int, list[tuple[Request, set[int]]]] = {}  # step id -> blocks each request writes
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.now = 0.0
        self.steps = 0

    def add(self, request_id: str, prompt: list[int], sampling: wire.SamplingParams) -> None:
        self.scheduler.add_request(request_id, prompt, sampling, self.now)
        self.outputs[request_id] = []

    def abort(self, request_id: str) -> None:
        self.record(self.scheduler.abort_request(request_id, self.now))
        self.check_pool()

    def step(self) -> wire.SchedulerOutput | None:
        """Schedule as far as the loop allows, then let the worker compute its oldest step.

        Returns the first step scheduled (serial: the only one).
        """
        first = None
        while self.loop.can_schedule():
            scheduled = self.loop.schedule(self.now)
            self.check_step(scheduled.output)
            self.record(scheduled.outcome)
            self.remember_writes(scheduled)
            self.to_worker.append(scheduled.output)
            first = first or scheduled.output
            if not scheduled.needs_result:
                break
        result = None
        while self.to_worker and result is None:
            output = self.to_worker.popleft()
            executed = self.worker.execute(output)
            result = None if output.is_empty else executed
        if result is not None:
            self.now += 1.0
            self.written.pop(result.step_id)
            self.record(self.loop.complete(result, self.now))
        self.check_pool()
        self.steps += 1
        return first

    def record(self, outcome: StepOutcome) -> None:
        for delta in outcome.all_deltas():
            self.outputs[delta.request_id].extend(delta.token_ids)
            assert delta.request_id not in self.finish_reasons, "a delta after the request ended"
            if delta.finish_reason is not None:
                self.finish_reasons[delta.request_id] = delta.finish_reason
            if delta.error is not None:
                self.errors[delta.request_id] = delta.error
        assert {r.request_id for r in outcome.finished} <= set(self.finish_reasons)

    def remember_writes(self, scheduled: ScheduledStep) -> None:
        """The blocks each request's tokens in this step go to (checked while the step is in flight)."""
        counts = {r.request_id: r.num_scheduled_tokens for r in scheduled.output.new_requests}
        counts.update((r.request_id, r.num_scheduled_tokens) for r in scheduled.output.running_requests)
        size = self.config.block_size
        writes = []
        for request, _, end, _ in scheduled.scheduled:
            start = end - counts[request.request_id]
            writes.append((request, set(request.block_ids[start // size : -(-end // size)])))
        self.written[scheduled.step_id] = writes

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

    def check_pool(self) -> None:
        pool = self.scheduler.pool
        holders: Counter[int] = Counter()
        for request in self.scheduler.requests.values():
            if request.status in (RequestStatus.RUNNING, RequestStatus.SUSPENDED):
                assert len(set(request.block_ids)) == len(request.block_ids)
                holders.update(request.block_ids)
            else:
                assert request.block_ids == [], "a waiting request holds blocks"
        holders.update(self.scheduler.releasing_block_ids())
        self.check_blocks_in_flight()
        self.check_reserve()
        for block in pool.blocks:
            assert block.ref_count == holders[block.block_id], f"block {block.block_id} ref count is off"
            if holders[block.block_id] > 1:
                assert block.block_hash is not None, "a block shared by live requests is not a cached prefix"
        preempted = sum(1 for r in self.scheduler.waiting if r.status is RequestStatus.PREEMPTED)
        preempted += sum(1 for r in self.scheduler.running if r.status is RequestStatus.SUSPENDED)
        assert self.scheduler.num_preempted_waiting == preempted
        if isinstance(self.scheduler, LegacyScheduler):
            self.check_legacy_pools()
        used = sum(1 for block in pool.blocks if block.ref_count > 0)
        assert pool.num_free_blocks + used == pool.num_blocks
        assert 0 <= pool.num_cached_free <= pool.num_free_blocks

    def check_legacy_pools(self) -> None:
        scheduler = self.scheduler
        live = [r for r in scheduler.requests.values() if r.status in (RequestStatus.RUNNING, RequestStatus.SUSPENDED)]
        decode = sum(scheduler.decode_blocks(r) for r in live)
        prefill = sum(len(r.block_ids) for r in live) - decode
        assert (scheduler.prefill_used, scheduler.decode_used) == (prefill, decode)
        assert scheduler.prefill_used <= scheduler.prefill_capacity, "the prefill table exceeded its share"
        assert scheduler.decode_used <= scheduler.decode_capacity, "the decode table exceeded its share"
        assert all(scheduler.decode_blocks(r) == 0 for r in live if r.status is RequestStatus.SUSPENDED)

    def check_blocks_in_flight(self) -> None:
        """No block a step in flight writes is free, or held by any other request."""
        pool = self.scheduler.pool
        for writes in self.written.values():
            for writer, block_ids in writes:
                for block_id in block_ids:
                    assert pool.blocks[block_id].ref_count > 0, f"block {block_id} freed while a step writes it"
                    others = [
                        r.request_id
                        for r in self.scheduler.requests.values()
                        if r is not writer and block_id in r.block_ids
                    ]
                    assert not others, f"block {block_id} handed to {others} while a step writes it"

    def check_reserve(self) -> None:
        """The incrementally kept admission reserve equals a recount over the running requests."""
        if isinstance(self.scheduler, LegacyScheduler):
            return
        reserve = self.scheduler.reserve
        owed = [reserve.owed_blocks(r) for r in self.scheduler.running]
        assert all(r.in_reserve for r in self.scheduler.running)
        assert (reserve.prompt_blocks, reserve.output_blocks) == (sum(p for p, _ in owed), sum(o for _, o in owed))
