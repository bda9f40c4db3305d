"""Who is served first: priorities (queue order, aging, who gives way) and a step budget in time."""

from __future__ import annotations

import pytest

from service.contract import wire
from service.scheduler.scheduler import SchedulerConfig
from service.scheduler.step_cost import MIN_OBSERVATIONS, StepCostModel
from tests.support.scheduler_harness import Harness, admitted_ids, greedy, reference_output

MODES = pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])


def config(**overrides) -> SchedulerConfig:
    values = dict(
        num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
        scheduling_policy="priority", priority_aging_s=1000.0,
    )  # fmt: skip
    values.update(overrides)
    return SchedulerConfig(**values)


def admission_order(harness: Harness) -> list[str]:
    """The requests admitted from here until idle, each once, where it was first admitted."""
    before = len(harness.admitted)
    harness.run_until_idle()
    return list(dict.fromkeys(harness.admitted[before:]))


# ---------------------------------------------------------------------- the queue


@pytest.mark.parametrize(
    ("policy", "expected"), [("fcfs", ["low", "high", "mid"]), ("priority", ["high", "mid", "low"])]
)
def test_the_waiting_queue_is_in_arrival_order_under_fcfs_and_in_priority_order_under_priority(policy, expected):
    harness = Harness(config(max_num_seqs=1, scheduling_policy=policy))
    harness.add("first", [1, 2], greedy(3), priority=-10)  # nobody preempts it
    harness.step()
    for request_id, priority in (("low", 5), ("high", -5), ("mid", 0)):
        harness.add(request_id, [3, 4], greedy(2), priority)
    assert admission_order(harness) == expected


def test_aging_serves_a_request_that_waited_its_priority_worth_before_a_better_newcomer():
    """aging 2 s a priority level: "low" (priority 1) arrived at 0 counts as arrived at 2; "high"
    (priority 0) arriving at 1 counts as 1 and goes first, one arriving at 3 counts as 3 and goes after."""
    harness = Harness(config(max_num_seqs=1, priority_aging_s=2.0))
    harness.add("holder", [1, 2], greedy(6))
    harness.step()
    harness.add("low", [3, 4], greedy(1), priority=1)
    harness.now = 1.0
    harness.add("early-high", [5, 6], greedy(1), priority=0)
    harness.now = 3.0
    harness.add("late-high", [7, 8], greedy(1), priority=0)
    assert admission_order(harness) == ["early-high", "low", "late-high"]


# ---------------------------------------------------------------------- who gives way


@MODES
def test_a_better_priority_takes_the_seat_of_the_lowest_priority_running_request(overlapped):
    """Both seats held by long low-priority streams: a priority-0 request preempts the lowest (priority
    5), is admitted in that same step, and the preempted stream resumes later with the same tokens."""
    harness = Harness(config(max_num_seqs=2), overlapped=overlapped)
    harness.add("low-5", [1] * 8, greedy(30), priority=5)
    harness.add("low-3", [2] * 8, greedy(30), priority=3)
    for _ in range(4):
        harness.step()
    harness.add("high", [3] * 6, greedy(4), priority=0)
    output = harness.step()
    assert output.preempted_request_ids == ["low-5"] and admitted_ids(output) == ["high"]
    harness.run_until_idle()
    for request_id, prompt, max_tokens in (("low-5", [1] * 8, 30), ("low-3", [2] * 8, 30), ("high", [3] * 6, 4)):
        assert harness.outputs[request_id] == reference_output(prompt, greedy(max_tokens), harness.config)
    assert harness.scheduler.counters.num_recomputed_tokens < 8  # "low-5" found its prompt's blocks again


def test_a_better_priority_gets_blocks_that_lower_priorities_hold():
    harness = Harness(config(num_blocks=12))
    harness.add("low", [1] * 36, greedy(8), priority=2)  # 9 of 12 blocks, 11 at the end
    harness.step()
    harness.add("high", [2] * 16, greedy(2), priority=0)  # 5 blocks: only if "low" gives way
    output = harness.step()
    assert output.preempted_request_ids == ["low"] and admitted_ids(output) == ["high"]
    harness.run_until_idle()
    assert harness.outputs["low"] == reference_output([1] * 36, greedy(8), harness.config)


def test_nobody_gives_way_to_an_equal_or_lower_priority():
    harness = Harness(config(max_num_seqs=1))
    harness.add("running", [1] * 4, greedy(10), priority=1)
    harness.step()
    harness.add("equal", [2] * 4, greedy(2), priority=1)
    harness.add("lower", [3] * 4, greedy(2), priority=4)
    while "running" in harness.scheduler.requests:
        output = harness.step()
        assert output is None or not output.preempted_request_ids
    harness.run_until_idle()
    assert harness.scheduler.counters.num_preemptions == 0


def test_an_old_low_priority_request_keeps_its_seat_once_it_has_waited_its_priority_worth():
    """aging 2 s a level: "low" (priority 1, arrived at 0) counts as arrived at 2; a priority-0 request
    arriving at 5 counts as 5 and may not preempt it."""
    harness = Harness(config(max_num_seqs=1, priority_aging_s=2.0))
    harness.add("low", [1] * 4, greedy(12), priority=1)
    harness.step()
    harness.now = 5.0
    harness.add("high", [2] * 4, greedy(2), priority=0)
    while "low" in harness.scheduler.requests:
        output = harness.step()
        assert output is None or not output.preempted_request_ids
        assert "high" not in admitted_ids(output)


@MODES
def test_when_blocks_run_out_the_lowest_priority_gives_them_back_first(overlapped):
    """Three decoding requests outgrow 9 blocks; "newest" would be lifo's victim, but "lowest" (priority
    3) has the lowest priority and goes first; "best" (priority 0, the most important) is never offered."""
    harness = Harness(config(num_blocks=9, preemption_policy="lifo"), overlapped=overlapped)
    harness.add("best", [1] * 4, greedy(10), priority=0)
    harness.add("lowest", [2] * 4, greedy(10), priority=3)
    harness.add("newest", [3] * 4, greedy(10), priority=1)
    harness.run_until_idle()
    victims = harness.preempted
    assert victims and victims[0] == "lowest" and "best" not in victims


# ---------------------------------------------------------------------- a step budget in time


def linear_step_seconds(output: wire.SchedulerOutput) -> float:
    """A device where a step costs 10 ms plus 1 ms per request and 2 ms per token."""
    return linear_step_seconds_of(len(output.new_requests) + len(output.running_requests), output.num_scheduled_tokens)


def linear_step_seconds_of(num_requests: int, num_tokens: int) -> float:
    return 0.010 + 0.001 * num_requests + 0.002 * num_tokens


def test_the_learned_step_cost_finds_the_device_s_coefficients():
    model = StepCostModel()
    for num_requests, num_tokens, attended in [(1, 200, 20_000), (4, 4, 4_000), (8, 60, 30_000), (2, 2, 500)] * 4:
        model.observe(num_requests, num_tokens, attended, 0.01 + 0.001 * num_requests + 0.002 * num_tokens)
    assert model.ready and model.num_observations >= MIN_OBSERVATIONS
    coefficients = model.coefficients()
    assert coefficients["fixed"] == pytest.approx(0.01, abs=1e-4)
    assert coefficients["per_request"] == pytest.approx(0.001, abs=1e-4)
    assert coefficients["per_token"] == pytest.approx(0.002, abs=1e-5)
    assert coefficients["per_context_kilotoken"] == pytest.approx(0.0, abs=1e-5)
    # 100 ms beside 4 decodes: 10 + 5 x 1 + 4 x 2 = 23 ms taken, 77 ms / 2 ms a token = 38 prompt tokens.
    assert model.prefill_tokens_within(0.1, num_decodes=4, decode_attended=400, prefill_context=0) == 38


@MODES
def test_prompt_chunks_keep_decoding_streams_within_the_latency_target(overlapped):
    """A 100 ms target on a device of 10 ms + 1 ms a request + 2 ms a token: while 4 streams decode, a
    long prompt goes in chunks of about 40 tokens (not the 256-token budget) and every stream gets a
    token each step; the steps stay near 100 ms once the cost is learned."""
    cfg = config(
        max_num_batched_tokens=256, num_blocks=512, max_model_len=2048, target_itl_s=0.1, scheduling_policy="fcfs"
    )
    harness = Harness(cfg, overlapped=overlapped, step_seconds=linear_step_seconds)
    streams = [f"stream-{i}" for i in range(4)]
    for request_id in streams:
        harness.add(request_id, [5, 6, 7], greedy(200))
    for _ in range(MIN_OBSERVATIONS + 4):
        harness.step()
    harness.add("long", list(range(1, 801)), greedy(1))
    step_seconds = []
    while not harness.outputs["long"]:
        before = {r: len(harness.outputs[r]) for r in streams}
        output = harness.step()
        step_seconds.append(linear_step_seconds(output))
        assert all(len(harness.outputs[r]) == before[r] + 1 for r in streams), "a stream missed a step"
    assert max(step_seconds[2:]) <= 0.1 * 1.1
    assert len(step_seconds) >= 800 // 45  # in chunks, not in three steps of 256


def test_a_prompt_alone_takes_the_whole_target_and_no_more():
    """Nothing else running: a step of prompt tokens fits the 100 ms target (45 tokens at 2 ms, beside
    10 + 1 ms), not the 256-token budget, so a request arriving meanwhile waits at most that long."""
    cfg = config(
        max_num_batched_tokens=256, num_blocks=512, max_model_len=2048, target_itl_s=0.1, scheduling_policy="fcfs"
    )
    harness = Harness(cfg, step_seconds=linear_step_seconds)
    for i in range(MIN_OBSERVATIONS + 2):  # teach the cost model, then let everything finish
        harness.add(f"warm-{i}", [i + 1, 2, 3] * (i + 1), greedy(2))
        harness.run_until_idle()
    harness.add("alone", list(range(1, 601)), greedy(1))
    for _ in range(3):
        assert 0.09 <= linear_step_seconds(harness.step()) <= 0.1


@MODES
@pytest.mark.parametrize("target_s", [0.1, 0.02], ids=["room-for-40-tokens", "room-for-one-block"])
def test_a_short_request_gets_in_while_a_long_prompt_prefills(overlapped, target_s):
    """While requests wait, a running prompt takes at most half of the step's prompt tokens: a short
    request arriving mid-prefill is admitted at the next step, not after the long prompt."""
    cfg = config(
        max_num_batched_tokens=256, num_blocks=512, max_model_len=2048, target_itl_s=0.1, scheduling_policy="fcfs"
    )
    harness = Harness(cfg, overlapped=overlapped, step_seconds=linear_step_seconds)
    harness.add("stream", [5, 6, 7], greedy(400))
    for _ in range(MIN_OBSERVATIONS + 4):
        harness.step()
    harness.add("long", list(range(1, 1001)), greedy(1))
    harness.step()
    harness.step()
    harness.add("short", [9, 9, 9], greedy(1))
    steps = 0
    while not harness.outputs["short"]:
        harness.step()
        steps += 1
    assert steps <= 3 and not harness.outputs["long"]


@MODES
def test_on_a_fresh_scheduler_the_first_long_prompt_leaves_a_short_request_its_target(overlapped):
    """Nothing timed yet (a cold server), a 2,048-token budget and a 100 ms target on a device of 10 ms +
    1 ms a request + 2 ms a token: the first long prompt goes in small chunks from its first step, so a
    short request sent during it is answered within a few targets, not after the prompt's 16 s; the
    prompt itself takes at most 1.3x its time in full-budget steps."""
    cfg = config(
        max_num_batched_tokens=2048, num_blocks=2048, max_model_len=8192, target_itl_s=0.1, scheduling_policy="fcfs"
    )
    step_times: list[float] = []
    harness = Harness(
        cfg,
        overlapped=overlapped,
        step_seconds=lambda out: step_times.append(linear_step_seconds(out)) or step_times[-1],
    )
    harness.add("long", list(range(1, 8001)), greedy(1))
    assert harness.step().num_scheduled_tokens <= 128  # the first chunk is small: nothing is known yet
    harness.step()
    sent_at = sum(step_times)
    harness.add("short", [9, 9, 9], greedy(1))
    while not harness.outputs["short"]:
        harness.step()
    assert sum(step_times) - sent_at <= 3 * 0.1 * 1.1
    while not harness.outputs["long"]:
        harness.step()
    full_budget_steps = [linear_step_seconds_of(1, 2048)] * 3 + [linear_step_seconds_of(1, 8000 - 3 * 2048)]
    assert sum(step_times) <= 1.3 * (sum(full_budget_steps) + linear_step_seconds_of(1, 3))
