"""What the step loop's frames cost to encode and decode (pytest-benchmark).

Compare within a group, as ratios from one run (`pytest tests/unit/test_wire_benchmark.py`): a step
of 1,024 decodes, its result, and one step's 1,024 deltas to one api replica as one frame each or
as one DeltaBatch.
"""

import pytest

from service import wire

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


@pytest.mark.benchmark(group="wire, one step's 1,024 deltas to one replica, encode + decode")
@pytest.mark.parametrize("shape", ["a frame per delta", "one DeltaBatch"])
def test_fanning_out_a_steps_deltas(benchmark, shape):
    step_deltas = deltas()

    def frames_per_delta() -> list[wire.RequestDelta]:
        return [wire.decode(wire.encode(delta)) for delta in step_deltas]

    def one_batch() -> list[wire.RequestDelta]:
        return wire.decode(wire.encode(wire.DeltaBatch(deltas=step_deltas))).deltas

    received = benchmark.pedantic(frames_per_delta if shape == "a frame per delta" else one_batch, rounds=ROUNDS)
    assert received == step_deltas


def test_a_frame_of_an_older_protocol_is_rejected():
    frame = wire.encode(wire.Ping(version=1))
    with pytest.raises(wire.WireError, match="protocol version 1"):
        wire.decode(frame)


def test_fields_travel_by_position_not_by_name():
    frame = wire.encode(wire.RequestDelta(request_id="r1", token_ids=[5]))
    assert b"request_id" not in frame and b"token_ids" not in frame
    assert wire.decode(frame) == wire.RequestDelta(request_id="r1", token_ids=[5])
