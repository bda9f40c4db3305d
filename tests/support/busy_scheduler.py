"""Schedulers kept busy for measuring a step: requests decoding that never finish, or a full server where one
request ends every step and the head of a long waiting queue takes its seat (benchmarks/bench_scheduler_step.py
times them; tests/unit/test_scheduler_step_cost.py holds them to what they claim)."""

from __future__ import annotations

import itertools
from collections import deque

from service.contract import wire
from service.scheduler.messages import new_request_message
from service.scheduler.scheduler import ScheduledStep, SchedulerConfig, build_scheduler
from service.scheduler.split_table import SplitTableConfig

PROMPT_LEN = 512


def config_for(num_running: int) -> SchedulerConfig:
    """`num_running` requests at most, with room for all of them beside the admission reserve
    (output counted up to 4096 tokens each) and for their prompts in one step."""
    return SchedulerConfig(
        num_blocks=512 * num_running,
        block_size=16,
        max_num_seqs=num_running,
        max_num_batched_tokens=PROMPT_LEN * num_running,
        max_model_len=8192,
    )


def sampled_result(step: ScheduledStep) -> wire.StepResult:
    output = step.output
    ids = [r.request_id for r in output.new_requests] + [r.request_id for r in output.running_requests]
    return wire.StepResult(step_id=output.step_id, sampled=[wire.SampledToken(request_id, 7) for request_id in ids])


def decoding_scheduler(split_table: SplitTableConfig | None, num_running: int = 64):
    """`num_running` requests past their prefill, decoding one token a step, never finishing."""
    scheduler = build_scheduler(config_for(num_running), split_table)
    sampling = wire.SamplingParams(max_tokens=4096, ignore_eos=True)
    for index in range(num_running):
        scheduler.add_request(f"r{index}", list(range(index, index + PROMPT_LEN)), sampling, 0.0)
    step = scheduler.schedule(0.0)
    scheduler.update(step, sampled_result(step), 0.0)
    return scheduler


def full_state_step(scheduler, step: wire.SchedulerOutput) -> wire.SchedulerOutput:
    """The same step as if every request were re-sent whole (what the proposal's v1 did).

    `step` already advanced each request's computed count by its one scheduled token.
    """
    resent = []
    for request in scheduler.running:
        request.num_computed_tokens -= 1
        resent.append(new_request_message(request, scheduler.kv.block_ids(request), 1))
        request.num_computed_tokens += 1
    return wire.SchedulerOutput(step_id=step.step_id, new_requests=resent)


class CountedQueue(deque):
    """A waiting queue that counts the requests read from it: taken from the front, indexed or walked over."""

    num_read = 0

    def popleft(self):
        self.num_read += 1
        return super().popleft()

    def __getitem__(self, index):
        self.num_read += 1
        return super().__getitem__(index)

    def __iter__(self):
        for request in super().__iter__():
            self.num_read += 1
            yield request


class BusyServer:
    """`num_running` requests decoding, one of them ending every step, and `num_waiting` queued
    behind them (a CountedQueue): each step admits the head of the queue into the freed slot,
    and a new arrival keeps the queue `num_waiting` long."""

    def __init__(self, num_running: int, num_waiting: int):
        self.scheduler = build_scheduler(config_for(num_running), None)
        self.num_waiting = num_waiting
        self.arrivals = itertools.count()
        for index in range(num_running):  # the i-th ends at step i, each admitted one `num_running` steps on
            self.arrive(index + 1)
        step = self.scheduler.schedule(0.0)
        self.scheduler.update(step, sampled_result(step), 0.0)
        self.queue = self.scheduler.waiting = CountedQueue(self.scheduler.waiting)
        self.top_up()

    def arrive(self, max_tokens: int) -> None:
        index = next(self.arrivals)
        sampling = wire.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(f"r{index}", list(range(index, index + PROMPT_LEN)), sampling, 0.0)

    def top_up(self) -> None:
        while len(self.scheduler.waiting) < self.num_waiting:
            self.arrive(self.scheduler.config.max_num_seqs)

    def step(self) -> tuple[wire.SchedulerOutput, int]:
        """One step: its output and how many waiting requests schedule() read."""
        self.queue.num_read = 0
        step = self.scheduler.schedule(0.0)
        num_read = self.queue.num_read
        self.scheduler.update(step, sampled_result(step), 0.0)
        self.top_up()
        return step.output, num_read
