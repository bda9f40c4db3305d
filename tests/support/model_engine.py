"""The real scheduler and engine loop driving a worker's ModelRunner in-process, with no sockets:
the worker tests run their model through real scheduling (chunked prefill, mixed steps,
preemption, prefix-cache hits) instead of a stand-in."""

from __future__ import annotations

from collections import deque

from service.contract import wire
from service.scheduler.engine import EngineLoop
from service.scheduler.request import Request
from service.scheduler.scheduler import ScheduledStep, SchedulerConfig, build_scheduler


class LocalEngine:
    """`runner` computes every step the scheduler sends, in order; EOS does not stop a request here."""

    def __init__(self, runner, max_num_batched_tokens: int, overlapped: bool = False, **config):
        config.setdefault("num_blocks", runner.num_kv_blocks)
        config.setdefault("max_model_len", runner.model_info.max_model_len)
        self.config = SchedulerConfig(
            block_size=runner.block_size, max_num_batched_tokens=max_num_batched_tokens, **config
        )
        self.runner = runner
        self.scheduler = build_scheduler(self.config)
        self.loop = EngineLoop(self.scheduler, overlapped)
        self.to_worker: deque[wire.SchedulerOutput] = deque()
        self.steps: list[ScheduledStep] = []
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, Request] = {}

    def add(self, request_id: str, prompt_ids: list[int], sampling: wire.SamplingParams) -> None:
        self.scheduler.add_request(request_id, prompt_ids, sampling, now=0.0)
        self.outputs[request_id] = []

    def run(self) -> dict[str, list[int]]:
        """Step until every request has ended; each one's output tokens."""
        while self.scheduler.has_work or self.loop.in_flight:
            self.loop.run(0.0, self._send)
            output = self.to_worker.popleft()
            result = self.runner.execute(output)
            if not output.is_empty:
                assert result.error is None, result.error
                self._record(self.loop.complete(result, 0.0))
        return {request_id: self.outputs[request_id] for request_id in self.finished}

    def run_pipelined(self) -> dict[str, list[int]]:
        """As run(), in the worker loop's order (worker/process.py's serve_pipelined): the
        next step is prepared while the one before computes, with the tokens that one samples pending.
        Use with overlapped=True, so the scheduler sends that next step before the result comes."""
        ahead = None  # (step, its prepared inputs)
        while self.scheduler.has_work or self.loop.in_flight or ahead is not None:
            if ahead is None:
                self.loop.run(0.0, self._send)
                output = self.to_worker.popleft()
                ahead = output, self.runner.prepare(output)
            (output, prepared), ahead = ahead, None
            if output.is_empty:
                continue
            launched = self.runner.launch(prepared)
            self.loop.run(0.0, self._send)
            if self.to_worker:
                following = self.to_worker.popleft()
                ahead = following, self.runner.prepare(following)
            result = self.runner.finish(launched)
            assert result.error is None, result.error
            self._record(self.loop.complete(result, 0.0))
        return {request_id: self.outputs[request_id] for request_id in self.finished}

    def num_chunked_prefills(self) -> int:
        """Prompt chunks that did not reach the end of their prompt."""
        return sum(
            request in step.not_sampling and count > 1
            for step in self.steps
            for request, count in zip(step.requests, self._counts(step))
        )

    def num_mixed_steps(self) -> int:
        """Steps that computed a prompt chunk beside a decode."""
        return sum(
            any(count == 1 and r not in step.not_sampling for r, count in zip(step.requests, self._counts(step)))
            and any(count > 1 for count in self._counts(step))
            for step in self.steps
        )

    @staticmethod
    def _counts(step: ScheduledStep) -> list[int]:
        counts = {r.request_id: r.num_scheduled_tokens for r in step.output.new_requests}
        counts.update((r.request_id, r.num_scheduled_tokens) for r in step.output.running_requests)
        return [counts[request.request_id] for request in step.requests]

    def _send(self, step: ScheduledStep) -> None:
        self.steps.append(step)
        self._record(step.outcome)
        self.to_worker.append(step.output)

    def _record(self, outcome) -> None:
        for delta in outcome.all_deltas():
            assert delta.error is None, delta.error
            self.outputs[delta.request_id].extend(delta.token_ids)
        self.finished.update((request.request_id, request) for request in outcome.finished)
