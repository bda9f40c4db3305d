"""What the step loop's frames cost to encode and decode (pytest-benchmark).

Run: python -m pytest benchmarks/bench_wire.py

Compare within a group, as ratios from one run: a step of 1,024 decodes, its result, and one step's 1,024 deltas
to one api replica as one frame each or as one DeltaBatch. (tests/integration/test_pytest_benchmarks.py runs each
case once, untimed.)
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's service
from service.contract import wire  # noqa: E402

NUM_REQUESTS = 1024
REQUEST_IDS = [f"{index:032x}" for index in range(NUM_REQUESTS)]
ROUNDS = 50


def decode_step() -> wire.SchedulerOutput:
    return wire.SchedulerOutput(step_id=7, running_requests=[wire.RunningRequest(i, [], 1) for i in REQUEST_IDS])


def step_result() -> wire.StepResult:
    return wire.StepResult(step_id=7, sampled=[wire.SampledToken(i, 1234) for i in REQUEST_IDS])


def deltas() -> list[wire.RequestDelta]:
    return [wire.RequestDelta(request_id=i, token_ids=[1234], num_prompt_tokens=8) for i in REQUEST_IDS]


@pytest.mark.benchmark(group="wire, scheduler <-> worker at 1,024 decodes")
@pytest.mark.parametrize("message", [decode_step(), step_result()], ids=["step", "result"])
@pytest.mark.parametrize("direction", ["encode", "decode"])
def test_coding_a_step_frame(benchmark, message, direction):
    frame = wire.encode(message)
    if direction == "encode":
        assert benchmark.pedantic(wire.encode, (message,), rounds=ROUNDS, warmup_rounds=5) == frame
    else:
        assert benchmark.pedantic(wire.decode, (frame,), rounds=ROUNDS, warmup_rounds=5) == message
    benchmark.extra_info["frame_bytes"] = len(frame)


@pytest.mark.benchmark(group="wire, one step's 1,024 deltas to one replica, build + encode + decode")
@pytest.mark.parametrize("shape", ["a frame per delta", "one DeltaBatch of structs", "one DeltaBatch of columns"])
def test_fanning_out_a_steps_deltas(benchmark, shape):
    """The scheduler's side (building what it sends, encoding it) and the api's (decoding it)."""

    def frames_per_delta() -> list[tuple[str, list[int]]]:
        return [(d.request_id, d.token_ids) for d in (wire.decode(wire.encode(delta)) for delta in deltas())]

    def batch_of_structs() -> list[tuple[str, list[int]]]:
        received = wire.decode(wire.encode(wire.DeltaBatch(deltas=deltas())))
        return [(delta.request_id, delta.token_ids) for delta in received.deltas]

    def batch_of_columns() -> list[tuple[str, list[int]]]:
        batch = wire.DeltaBatch(token_request_ids=list(REQUEST_IDS), token_ids=[1234] * NUM_REQUESTS)
        return [(delta.request_id, delta.token_ids) for delta in wire.decode(wire.encode(batch)).all_deltas()]

    shapes = {"a frame per delta": frames_per_delta, "one DeltaBatch of structs": batch_of_structs}
    received = benchmark.pedantic(shapes.get(shape, batch_of_columns), rounds=ROUNDS)
    assert received == [(request_id, [1234]) for request_id in REQUEST_IDS]
