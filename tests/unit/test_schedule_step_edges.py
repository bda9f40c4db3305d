"""Edges of one scheduling step: seats, the counters admission and preemption keep, who gives way
to a better priority at a tie, the step budget before the cost model is trusted, and a split-table
victim that ends instead of being suspended."""

from __future__ import annotations

import pytest

from service.contract import wire
from service.scheduler.scheduler import SchedulerConfig
from service.scheduler.split_table import INCOMPLETE, SplitTableConfig
from tests.support.scheduler_harness import Harness, admitted_ids, greedy, reference_output


def config(**overrides) -> SchedulerConfig:
    values = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    values.update(overrides)
    return SchedulerConfig(**values)


def scheduled_tokens(output: wire.SchedulerOutput) -> dict[str, int]:
    return {r.request_id: r.num_scheduled_tokens for r in output.new_requests + output.running_requests}


# ---------------------------------------------------------------------- seats and counters


def test_newcomers_get_only_the_seats_the_running_requests_leave():
    harness = Harness(config(max_num_seqs=2))
    harness.add("first", [1] * 4, greedy(8))
    harness.step()
    harness.add("second", [2] * 4, greedy(8))
    harness.add("third", [3] * 4, greedy(8))
    assert admitted_ids(harness.step()) == ["second"]
    assert len(harness.scheduler.running) == 2


def test_prompt_token_and_prefix_cache_query_counters_add_up_over_every_admitted_request():
    harness = Harness(config())
    harness.add("a", [1] * 8, greedy(2))
    harness.add("b", [2] * 6, greedy(2))
    harness.step()
    harness.add("c", [3] * 5, greedy(2))
    harness.run_until_idle()
    counters = harness.scheduler.counters
    assert counters.num_prompt_tokens == 19
    assert counters.prefix_cache_queries == 19


def test_every_preemption_is_counted_for_its_request_and_in_total():
    """Four long streams in a table too small for them: one stream gives way more than once; the
    total counts each preemption, and each request reports its own."""
    harness = Harness(config(num_blocks=12, max_num_batched_tokens=32, max_model_len=64))
    requests = []
    for index in range(4):
        harness.add(f"r{index}", [index + 1] * 6, greedy(30))
        requests.append(harness.scheduler.requests[f"r{index}"])
    harness.run_until_idle()
    per_request = [r.num_preemptions for r in requests]
    assert max(per_request) >= 2
    assert harness.scheduler.counters.num_preemptions == sum(per_request)
    for index in range(4):
        assert harness.outputs[f"r{index}"] == reference_output([index + 1] * 6, greedy(30), harness.config)


# ---------------------------------------------------------------------- who gives way to a better priority


def test_a_running_request_whose_aged_key_ties_the_waiting_one_keeps_its_seat():
    """aging 2 s a level: "low" (priority 1, arrived at 0) counts as arrived at 2, as "high" (priority
    0, arriving at 2) does. A tie is no reason to give way."""
    harness = Harness(config(max_num_seqs=1, scheduling_policy="priority", priority_aging_s=2.0))
    harness.add("low", [1] * 4, greedy(6), priority=1)
    harness.step()
    harness.now = 2.0
    harness.add("high", [2] * 4, greedy(2), priority=0)
    output = harness.step()
    assert output.preempted_request_ids == []
    assert harness.scheduler.counters.num_preemptions == 0


def test_a_request_of_the_same_priority_never_gives_way_to_an_earlier_arrival():
    """ "late" (priority 0) got in past "early" (priority 0), whose prompt did not fit then; a request
    gives way only to a better priority, so "late" keeps its blocks while "early" waits."""
    harness = Harness(config(num_blocks=10, scheduling_policy="priority", priority_aging_s=1000.0))
    harness.add("holder", [1] * 16, greedy(12))
    harness.step()
    harness.now = 1.0
    harness.add("early", [2] * 20, greedy(2))
    harness.now = 2.0
    harness.add("late", [3] * 4, greedy(12))
    assert admitted_ids(harness.step()) == ["late"]
    for _ in range(5):
        assert harness.step().preempted_request_ids == []
    assert "early" not in [r.request_id for r in harness.scheduler.running]


# ---------------------------------------------------------------------- the step budget in time


def test_before_the_cost_model_is_trusted_a_latency_target_leaves_the_token_budget_whole():
    """A target inter-token latency with no step observed yet: the prompt takes the whole token
    budget in its first step, not a time-limited share."""
    harness = Harness(config(max_num_batched_tokens=64, target_itl_s=0.001), step_seconds=lambda output: 1.0)
    harness.add("prompt", [1] * 40, greedy(2))
    assert scheduled_tokens(harness.step()) == {"prompt": 40}


# ---------------------------------------------------------------------- split table: a victim that ends


def test_a_split_table_victim_with_recovery_off_ends_incomplete_at_the_time_of_the_step():
    """Recovery disabled: the request that must give back decode blocks ends instead, and its end is
    stamped with the scheduling time (the latency metrics read it)."""
    harness = Harness(
        SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=64, max_model_len=64),
        SplitTableConfig(kv_cache_ratio=0.5, dec_blocks=0, disable_recover=True),
    )
    requests = []
    for index in range(3):
        harness.add(f"r{index}", [index + 1] * 4, greedy(20))
        requests.append(harness.scheduler.requests[f"r{index}"])
    harness.run_until_idle()
    ended = [r for r in requests if harness.errors.get(r.request_id) == INCOMPLETE]
    assert harness.scheduler.counters.num_preemptions == 0
    assert ended
    for request in ended:
        assert isinstance(request.finish_time, float)
        assert request.finish_time >= request.arrival_time


def test_a_full_token_budget_of_decodes_is_scheduled_in_one_step():
    """A token budget of 3 and three one-token prompts: every step decodes all three."""
    harness = Harness(config(max_num_batched_tokens=3))
    for index in range(3):
        harness.add(f"r{index}", [index + 1], greedy(5))
    assert scheduled_tokens(harness.step()) == {"r0": 1, "r1": 1, "r2": 1}
    for _ in range(4):
        assert scheduled_tokens(harness.step()) == {"r0": 1, "r1": 1, "r2": 1}


def time_limited_trace(block_size: int, target_itl_s: float) -> tuple[Harness, list[tuple[bool, int, dict]]]:
    """A decode stream and prompts of many lengths teach the cost model (a step costs 1 ms a token);
    then two 24-token prompts arrive. Per step: whether requests waited, the prompt tokens left to
    compute, the prompt budget, the step."""
    harness = Harness(
        config(block_size=block_size, target_itl_s=target_itl_s),
        step_seconds=lambda output: 0.001 * output.num_scheduled_tokens,
    )
    harness.add("decode", [1] * 4, greedy(60))
    for index in range(10):
        harness.add(f"warm{index}", [5 + index] * (3 * index + 2), greedy(1))
        harness.step()
    harness.add("p", [2] * 24, greedy(2))
    harness.add("w", [3] * 24, greedy(2))
    trace = []
    while harness.scheduler.requests:
        waited = bool(harness.scheduler.waiting)
        prompts_left = {
            r.request_id: len(r.prompt_token_ids) - r.num_computed_tokens
            for r in harness.scheduler.requests.values()
            if r.num_computed_tokens < len(r.prompt_token_ids)
        }
        output = harness.step()
        trace.append((waited, prompts_left, harness.scheduler.prefill_budget, output))
    return harness, trace


def test_with_a_latency_target_prompts_share_the_time_budget_and_decodes_never_wait():
    """Once the cost model is trusted, a step's prompt chunks stay within its prompt budget; while others wait, a prompt already running takes at most half of it
    (at least one token); the decode stream is in every step; every output is the undisturbed one."""
    for block_size, target_itl_s in ((2, 0.003), (4, 0.005), (4, 0.008)):
        harness, trace = time_limited_trace(block_size, target_itl_s)
        assert harness.scheduler.step_cost.ready
        assert any(prefill_budget < harness.config.max_num_batched_tokens for _, _, prefill_budget, _ in trace)
        halves = []
        for waited, prompts_left, prefill_budget, output in trace:
            tokens = scheduled_tokens(output)
            if "decode" in harness.outputs and len(harness.outputs["decode"]) < 60:
                assert tokens.get("decode") == 1
            running_prompt_chunks = [
                r.num_scheduled_tokens for r in output.running_requests if r.request_id in prompts_left
            ]
            new_prompt_tokens = sum(r.num_scheduled_tokens for r in output.new_requests)
            charged = sum(chunk for chunk in running_prompt_chunks if chunk > 1)  # a last prompt token runs as a decode
            assert charged + new_prompt_tokens <= prefill_budget
            if waited:
                assert all(chunk <= max(1, prefill_budget // 2) for chunk in running_prompt_chunks)
                halves += [chunk == max(1, prefill_budget // 2) for chunk in running_prompt_chunks]
        assert any(halves)
        assert harness.outputs["p"] == reference_output([2] * 24, greedy(2), harness.config)
        assert harness.outputs["decode"] == reference_output([1] * 4, greedy(60), harness.config)


def test_the_last_token_of_the_budget_still_admits_a_waiting_prompt():
    """A budget of 3, two streams decoding: the token left starts the waiting prompt's first chunk."""
    harness = Harness(config(max_num_batched_tokens=3))
    harness.add("r0", [1], greedy(6))
    harness.add("r1", [2], greedy(6))
    harness.step()
    harness.add("late", [3] * 4, greedy(2))
    assert scheduled_tokens(harness.step()) == {"r0": 1, "r1": 1, "late": 1}


@pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_crowded_table_with_a_small_token_budget_serves_every_request_its_undisturbed_output(overlapped, policy):
    """Chunked prompts, decodes that gain blocks, preemptions and priorities in one small table: every
    step stays within the token budget and the seats (the harness checks), and every output is the one
    an undisturbed run yields."""
    harness = Harness(
        config(num_blocks=14, block_size=2, max_num_seqs=4, max_num_batched_tokens=7, max_model_len=32,
               scheduling_policy=policy, priority_aging_s=50.0),
        overlapped=overlapped,
    )  # fmt: skip
    prompts = {}
    for index in range(12):
        request_id = f"r{index}"
        prompts[request_id] = ([index % 5 + 1] * (index % 4 * 3 + 1), greedy(index % 3 * 5 + 4))
        harness.add(request_id, *prompts[request_id], priority=index % 3)
        harness.step()
    harness.run_until_idle()
    assert harness.scheduler.counters.num_preemptions > 0
    for request_id, (prompt, sampling) in prompts.items():
        assert harness.outputs[request_id] == reference_output(prompt, sampling, harness.config)
