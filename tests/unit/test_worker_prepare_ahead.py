"""The worker builds step N+1's inputs while step N computes: the tokens N samples are filled in after."""

import queue

import numpy as np
import pytest

from service.contract import wire
from worker.inputs.step_inputs import PENDING_TOKEN, RequestState, StepError, build_step_inputs, fill_pending_tokens
from worker.process import serve_pipelined

BLOCK_SIZE = 4


def state(request_id: str, token_ids: list[int], computed: int, awaiting: bool) -> RequestState:
    return RequestState(
        request_id=request_id,
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        sampling=wire.SamplingParams(),
        block_ids=[0, 1],
        num_computed_tokens=computed,
        awaiting_token=awaiting,
    )


def test_inputs_built_ahead_leave_the_awaited_token_pending_until_it_is_sampled():
    decoding = state("decoding", [5, 6, 7], computed=3, awaiting=True)  # the step in flight samples token 3
    prefilling = state("prefilling", [8, 9, 10, 11, 12], computed=2, awaiting=False)
    inputs = build_step_inputs([(decoding, 1), (prefilling, 3)], BLOCK_SIZE, num_blocks=4)
    assert inputs.input_ids.tolist() == [PENDING_TOKEN, 10, 11, 12]
    assert inputs.positions.tolist() == [3, 2, 3, 4]
    assert inputs.sampling_requests == [decoding, prefilling]  # both reach their last known-or-awaited token
    assert fill_pending_tokens(inputs) == [decoding]  # the step before sampled nothing for it (yet)
    assert inputs.input_ids.tolist() == [PENDING_TOKEN, 10, 11, 12]
    decoding.token_ids.append(42)
    assert fill_pending_tokens(inputs) == []
    assert inputs.input_ids.tolist() == [42, 10, 11, 12]


def test_a_request_not_awaiting_a_token_cannot_be_scheduled_past_its_tokens():
    idle = state("idle", [5, 6, 7], computed=3, awaiting=False)
    with pytest.raises(StepError, match="schedules more tokens than it has"):
        build_step_inputs([(idle, 1)], BLOCK_SIZE, num_blocks=4)
    assert np.all(build_step_inputs([(state("ok", [5, 6, 7], 2, False), 1)], BLOCK_SIZE, 4).input_ids == [7])


class RecordingRunner:
    """Records the order of its parts; each step "computes" until the next step has been taken in."""

    def __init__(self):
        self.calls: list[str] = []

    def prepare(self, step):
        self.calls.append(f"prepare {step.step_id}")
        return step

    def launch(self, step):
        self.calls.append(f"launch {step.step_id}")
        return step

    def remaining_s(self, step):
        return 1.0  # long enough for the next step to come

    def finish(self, step):
        self.calls.append(f"finish {step.step_id}")
        return wire.StepResult(step_id=step.step_id)


class QueueLink:
    def __init__(self, steps):
        self.steps: queue.SimpleQueue = queue.SimpleQueue()
        for step in steps:
            self.steps.put(step)
        self.sent: list[int] = []

    def next_step(self, timeout_s):
        try:
            return self.steps.get(timeout=timeout_s) if timeout_s > 0 else self.steps.get_nowait()
        except queue.Empty:
            return None

    def send(self, result):
        self.sent.append(result.step_id)


def decode_step(step_id: int) -> wire.SchedulerOutput:
    return wire.SchedulerOutput(step_id=step_id, running_requests=[wire.RunningRequest("r", [], 1)])


def test_the_worker_loop_prepares_the_next_step_before_it_finishes_the_current_one():
    runner = RecordingRunner()
    only_drops = wire.SchedulerOutput(step_id=3, finished_request_ids=["gone"])
    link = QueueLink([decode_step(1), decode_step(2), only_drops, decode_step(4)])
    serve_pipelined(runner, link, serving=lambda: len(link.sent) < 3)
    assert runner.calls == [
        "prepare 1",
        "launch 1",
        "prepare 2",  # while step 1 computes
        "finish 1",
        "launch 2",
        "prepare 3",  # its state changes are taken in order; it computes nothing
        "finish 2",
        "prepare 4",
        "launch 4",
        "finish 4",
    ]
    assert link.sent == [1, 2, 4]
