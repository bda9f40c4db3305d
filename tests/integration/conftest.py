"""Shared pieces of the worker tests: the SmolLM2 file, its transformers tokenizer, a scheduler stand-in."""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from service import wire
from service.config import default_model_path


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path):
    """transformers' tokenizer for the same GGUF: the reference for ours."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(smollm_path.parent), gguf_file=smollm_path.name)


@dataclass
class PlannedRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: wire.SamplingParams
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_sent_blocks: int = 0
    on_worker: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class SchedulerDouble:
    """Plays the scheduler for a ModelRunner: FCFS, a token budget per step, chunked prefill,
    running requests first, block allocation as sequences grow, preemption on request.

    Requests run until `sampling.max_tokens` output tokens (EOS is not a stop here).
    """

    def __init__(self, runner, token_budget: int):
        self.runner = runner
        self.block_size = runner.block_size
        self.token_budget = token_budget
        self.free_blocks = deque(range(runner.num_kv_blocks))
        self.requests: dict[str, PlannedRequest] = {}
        self.step_id = 0
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self.done: dict[str, PlannedRequest] = {}
        self.num_mixed_steps = 0  # steps holding both a prefill chunk and a decode
        self.num_chunked_prefills = 0  # prefill chunks that did not reach the end of the prompt

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: wire.SamplingParams,
        cached_block_ids: tuple[int, ...] = (),
    ) -> None:
        """Queue a request; `cached_block_ids` are full blocks of its prefix already in the cache."""
        request = PlannedRequest(request_id, list(prompt_ids), sampling, block_ids=list(cached_block_ids))
        request.num_computed_tokens = len(cached_block_ids) * self.block_size
        for block_id in cached_block_ids:
            self.free_blocks.remove(block_id)
        self.requests[request_id] = request

    def preempt(self, request_id: str) -> None:
        """Free the request's blocks; it will come back as a NewRequest holding prompt + output."""
        request = self.requests[request_id]
        self.free_blocks.extend(request.block_ids)
        request.block_ids, request.num_computed_tokens, request.num_sent_blocks = [], 0, 0
        request.on_worker = False
        self.preempted.append(request_id)

    def step(self) -> None:
        """Schedule one step, run it on the worker and apply its sampled tokens."""
        budget = self.token_budget
        running, new = [], []
        kinds = set()
        ordered = sorted(self.requests.values(), key=lambda r: not r.on_worker)
        for request in ordered:
            num_tokens = min(len(request.token_ids) - request.num_computed_tokens, budget)
            if num_tokens <= 0:
                continue
            budget -= num_tokens
            self._allocate(request, request.num_computed_tokens + num_tokens)
            remaining = len(request.token_ids) - request.num_computed_tokens
            kinds.add("decode" if request.output_ids and remaining == 1 else "prefill")
            self.num_chunked_prefills += num_tokens < remaining
            if request.on_worker:
                new_block_ids = request.block_ids[request.num_sent_blocks :]
                running.append(wire.RunningRequest(request.request_id, new_block_ids, num_tokens))
            else:
                new.append(
                    wire.NewRequest(
                        request_id=request.request_id,
                        token_ids=request.token_ids,
                        num_prompt_tokens=len(request.prompt_ids),
                        sampling=request.sampling,
                        block_ids=list(request.block_ids),
                        num_computed_tokens=request.num_computed_tokens,
                        num_scheduled_tokens=num_tokens,
                    )
                )
                request.on_worker = True
            request.num_sent_blocks = len(request.block_ids)
            request.num_computed_tokens += num_tokens
        self.num_mixed_steps += kinds == {"decode", "prefill"}
        output = wire.SchedulerOutput(
            step_id=self.step_id,
            new_requests=new,
            running_requests=running,
            finished_request_ids=self.finished,
            preempted_request_ids=self.preempted,
        )
        self.step_id += 1
        self.finished, self.preempted = [], []
        result = self.runner.execute(output)
        assert result.error is None, result.error
        for sampled in result.sampled:
            self._append(self.requests[sampled.request_id], sampled.token_id)

    def _allocate(self, request: PlannedRequest, num_tokens: int) -> None:
        while len(request.block_ids) * self.block_size < num_tokens:
            request.block_ids.append(self.free_blocks.popleft())

    def _append(self, request: PlannedRequest, token_id: int) -> None:
        request.output_ids.append(token_id)
        if len(request.output_ids) >= request.sampling.max_tokens:
            self.finished.append(request.request_id)
            self.free_blocks.extend(request.block_ids)
            del self.requests[request.request_id]
            self.done[request.request_id] = request

    def run(self, preempt: dict[str, int] | None = None) -> dict[str, list[int]]:
        """Step until every request is done; `preempt` = {request id: preempt it once it has this many outputs}."""
        pending = dict(preempt or {})
        while self.requests:
            for request_id, num_outputs in list(pending.items()):
                request = self.requests.get(request_id)
                if request is not None and len(request.output_ids) >= num_outputs:
                    self.preempt(request_id)
                    del pending[request_id]
            self.step()
        if self.finished:  # let the worker drop the state of the last ones too
            self.runner.execute(wire.SchedulerOutput(step_id=self.step_id, finished_request_ids=self.finished))
            self.step_id, self.finished = self.step_id + 1, []
        assert not pending, f"never preempted: {pending}"
        return {request_id: request.output_ids for request_id, request in self.done.items()}


@pytest.fixture
def scheduler_double():
    """`scheduler_double(runner, token_budget)` -> SchedulerDouble."""
    return SchedulerDouble
