"""The edges of a step's result, driven through Scheduler.schedule/update with hand-made worker
answers: refusals, errors, tokens for requests that ended or gave way while their step computed,
token timings and counters, the step's cost terms, aborts and the loss of the worker.

Each test pins one rule so that changing it (a mutant) fails a test with its name.
"""

from __future__ import annotations

from service.contract import wire
from service.scheduler.admission import ReserveAdmission
from service.scheduler.kv_cache_manager import KVCacheManager
from service.scheduler.preemption import RecomputePreemption
from service.scheduler.request import FinishReason, RequestStatus
from service.scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig, build_scheduler
from tests.support.scheduler_harness import Harness, greedy

PROMPT_A = [1, 2, 3, 4]  # one full block each (block_size 4), no shared prefix
PROMPT_B = [5, 6, 7, 8]
PROMPT_C = [9, 10, 11, 12]


def scheduler(**overrides):
    values = dict(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    values.update(overrides)
    return build_scheduler(SchedulerConfig(**values))


def answer(step: ScheduledStep, token_id: int = 7, **fields) -> wire.StepResult:
    """The worker's result: one token for every request the step samples."""
    sampled = [wire.SampledToken(r.request_id, token_id) for r in step.requests if r not in step.not_sampling]
    return wire.StepResult(step_id=step.step_id, sampled=sampled, **fields)


def deltas_by_id(outcome) -> dict:
    return {delta.request_id: delta for delta in outcome.all_deltas()}


def two_block_scheduler() -> Scheduler:
    """A table of two blocks and no admission reserve: two short requests fill it at once."""
    config = SchedulerConfig(num_blocks=2, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
    admission = ReserveAdmission(kv, init_ratio=0.0, min_ratio=0.0)
    return Scheduler(config, kv, admission, RecomputePreemption(kv, config.preemption_policy))


def two_running_then_one_gives_way(sched):
    """A and B take the only two blocks in step 1; step 2 is scheduled while step 1 computes (overlapped)
    and A's next token needs the block B holds: B (not the longest-running) is preempted. Returns both steps."""
    sched.add_request("a", PROMPT_A, greedy(4), 0.0)
    sched.add_request("b", [5, 6], greedy(4), 0.0)
    first = sched.schedule(0.0)
    assert [r.request_id for r in first.requests] == ["a", "b"]
    second = sched.schedule(0.0)
    assert second.output.preempted_request_ids == ["b"]
    return first, second


def test_refused_request_ends_with_a_400_naming_the_workers_reason():
    sched = scheduler()
    sched.add_request("a", PROMPT_A, greedy(8), 0.0)
    sched.add_request("b", PROMPT_B, greedy(8), 0.0)
    step = sched.schedule(0.0)
    result = wire.StepResult(
        step_id=step.step_id, sampled=[wire.SampledToken("b", 7)], refused={"a": "logit_bias out of range"}
    )
    outcome = sched.update(step, result, 3.0)
    delta = deltas_by_id(outcome)["a"]
    assert delta.finish_reason == "error"
    assert delta.error == "the worker refused it: logit_bias out of range"
    assert delta.error_status == 400
    (ended,) = outcome.finished
    assert ended.request_id == "a" and ended.finish_reason is FinishReason.ERROR and ended.finish_time == 3.0
    assert "a" not in sched.requests
    assert outcome.tokens[b""] == (["b"], [7])


def test_missing_token_without_a_refusal_is_a_500():
    sched = scheduler()
    sched.add_request("a", PROMPT_A, greedy(8), 0.0)
    step = sched.schedule(0.0)
    outcome = sched.update(step, wire.StepResult(step_id=step.step_id, refused={"other": "x"}), 1.0)
    delta = deltas_by_id(outcome)["a"]
    assert (delta.error, delta.error_status) == ("the worker returned no token", 500)


def test_token_gaps_are_the_seconds_between_a_requests_tokens():
    sched = scheduler()
    sched.add_request("a", PROMPT_A, greedy(8), 0.0)
    first = sched.update(step := sched.schedule(0.0), answer(step), 1.0)
    assert [r.request_id for r in first.first_tokens] == ["a"] and first.token_gaps_s == []
    second = sched.update(step := sched.schedule(1.0), answer(step), 3.5)
    assert second.first_tokens == [] and second.token_gaps_s == [2.5]
    third = sched.update(step := sched.schedule(3.5), answer(step), 4.0)
    assert third.first_tokens == [] and third.token_gaps_s == [0.5]
    request = sched.requests["a"]
    assert (request.first_token_time, request.last_token_time) == (1.0, 4.0)


def test_request_that_reaches_its_length_finishes_at_the_steps_time():
    sched = scheduler()
    sched.add_request("a", PROMPT_A, greedy(max_tokens=1), 0.0)
    outcome = sched.update(step := sched.schedule(0.0), answer(step), 2.0)
    (ended,) = outcome.finished
    assert ended.finish_reason is FinishReason.LENGTH and ended.finish_time == 2.0


def test_generation_tokens_counter_adds_up_over_steps():
    sched = scheduler()
    sched.add_request("a", PROMPT_A, greedy(8), 0.0)
    sched.add_request("b", PROMPT_B, greedy(8), 0.0)
    for now in (1.0, 2.0, 3.0):
        sched.update(step := sched.schedule(now), answer(step), now)
    assert sched.counters.num_generation_tokens == 6


def test_every_token_computed_for_an_aborted_request_counts_as_wasted():
    sched = scheduler()
    sched.add_request("a", PROMPT_A, greedy(8), 0.0)
    sched.add_request("b", PROMPT_B, greedy(8), 0.0)
    step = sched.schedule(0.0)
    sched.abort_request("a", 0.5)
    sched.abort_request("b", 0.5)
    outcome = sched.update(step, answer(step), 1.0)
    assert outcome.all_deltas() == []
    assert sched.counters.num_wasted_decode_slots == 2


def test_abort_finishes_the_request_at_the_time_given():
    sched = scheduler()
    sched.add_request("a", PROMPT_A, greedy(8), 0.0)
    outcome = sched.abort_request("a", 4.0)
    (ended,) = outcome.finished
    assert ended.finish_reason is FinishReason.ABORT and ended.finish_time == 4.0


def test_worker_error_spares_a_request_aborted_while_the_step_computed():
    sched = scheduler()
    sched.add_request("a", PROMPT_A, greedy(8), 0.0)
    sched.add_request("b", PROMPT_B, greedy(8), 0.0)
    step = sched.schedule(0.0)
    sched.abort_request("a", 0.5)
    outcome = sched.update(step, wire.StepResult(step_id=step.step_id, error="boom"), 1.0)
    assert [r.request_id for r in outcome.finished] == ["b"]
    assert deltas_by_id(outcome)["b"].error == "worker error: boom"


def test_token_of_the_step_in_flight_is_taken_when_another_request_gave_way():
    sched = two_block_scheduler()
    first, second = two_running_then_one_gives_way(sched)
    outcome = sched.update(first, answer(first, token_id=7), 1.0)
    assert {d.request_id: d.token_ids for d in outcome.all_deltas()} == {"a": [7]}
    assert sched.requests["a"].token_ids == PROMPT_A + [7]
    assert sched.requests["b"].token_ids == [5, 6]  # its token is void: it is recomputed


def test_worker_error_spares_a_request_preempted_since_its_step():
    sched = two_block_scheduler()
    first, second = two_running_then_one_gives_way(sched)
    outcome = sched.update(first, wire.StepResult(step_id=first.step_id, error="boom"), 1.0)
    assert [r.request_id for r in outcome.finished] == ["a"]
    assert sched.requests["b"].status is RequestStatus.PREEMPTED


def test_worker_loss_leaves_no_preempted_request_counted():
    sched = two_block_scheduler()
    two_running_then_one_gives_way(sched)
    assert sched.num_preempted_waiting == 1
    outcome = sched.fail_all("the worker is gone", 2.0)
    assert sorted(r.request_id for r in outcome.finished) == ["a", "b"]
    assert sched.num_preempted_waiting == 0
    # and the scheduler serves on: a new request may be preempted and counted again
    sched.add_request("c", PROMPT_A, greedy(4), 3.0)
    sched.add_request("d", [5, 6], greedy(4), 3.0)
    sched.schedule(3.0)
    sched.schedule(3.0)
    assert sched.num_preempted_waiting == 1


def test_step_cost_learns_only_timed_steps_and_only_with_a_latency_target():
    untargeted = scheduler()
    untargeted.add_request("a", PROMPT_A, greedy(8), 0.0)
    untargeted.update(step := untargeted.schedule(0.0), answer(step, compute_s=0.01), 1.0)
    assert untargeted.step_cost.num_observations == 0
    targeted = scheduler(target_itl_s=0.05)
    targeted.add_request("a", PROMPT_A, greedy(8), 0.0)
    targeted.update(step := targeted.schedule(0.0), answer(step), 1.0)  # an untimed step (compute_s 0)
    assert targeted.step_cost.num_observations == 0
    targeted.update(step := targeted.schedule(1.0), answer(step, compute_s=0.01), 2.0)
    assert targeted.step_cost.num_observations == 1


def test_cost_terms_count_requests_tokens_and_the_context_they_read():
    sched = scheduler(target_itl_s=0.05)
    sched.add_request("a", PROMPT_A, greedy(8), 0.0)
    sched.add_request("b", PROMPT_B, greedy(8), 0.0)
    prefill = sched.schedule(0.0)  # two 4-token chunks from nothing: each token reads 4 on average
    assert prefill.cost_terms == (2, 8, 2 * 4 * 4)
    sched.update(prefill, answer(prefill), 1.0)
    growing = sched.schedule(1.0)  # two decodes that each take a new block, reading 4 + 1
    assert [len(r.new_block_ids) for r in growing.output.running_requests] == [1, 1]
    assert growing.cost_terms == (2, 2, 2 * 5)
    sched.update(growing, answer(growing), 2.0)
    decoding = sched.schedule(2.0)  # two plain decodes into the blocks they hold, reading 5 + 1 each
    assert decoding.cost_terms == (2, 2, 2 * 6)
    sched.update(decoding, answer(decoding), 3.0)
    sched.add_request("c", PROMPT_C, greedy(8), 3.0)
    mixed = sched.schedule(3.0)  # a 4-token chunk beside two decodes reading 6 + 1 each
    assert mixed.cost_terms == (3, 4 + 2, 4 * 4 + 2 * 7)


def test_recomputed_tokens_are_the_tokens_computed_beyond_each_requests_own():
    """Without a prefix cache, every token a request keeps is computed once (all but the last sampled one);
    whatever the worker computed beyond that was recomputation after preemption, and is counted as such.
    Here two requests give way to a better priority at once and come back in the same step."""
    harness = Harness(
        SchedulerConfig(
            num_blocks=6,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            enable_prefix_caching=False,
            scheduling_policy="priority",
        )
    )
    prompts = {"low0": [1, 2, 3, 4, 5, 6], "low1": [9, 10, 11, 12, 13, 14], "high": list(range(40, 56))}
    harness.add("low0", prompts["low0"], greedy(6), priority=5)
    harness.add("low1", prompts["low1"], greedy(6), priority=5)
    computed = sum(harness.step().num_scheduled_tokens for _ in range(3))
    harness.add("high", prompts["high"], greedy(2), priority=0)
    while harness.scheduler.requests:
        output = harness.step()
        computed += output.num_scheduled_tokens if output is not None else 0
    assert harness.scheduler.counters.num_preemptions == 2
    kept = sum(len(prompts[request_id]) + len(tokens) - 1 for request_id, tokens in harness.outputs.items())
    assert harness.scheduler.counters.num_recomputed_tokens == computed - kept > 0


def test_prompt_chunks_shrink_as_the_context_they_read_grows():
    """With a latency target and attention that costs, each chunk of a long prompt reads more context than
    the one before, so fewer of its tokens fit in the target beside the running decode."""
    sched = scheduler(
        num_blocks=1024, max_num_batched_tokens=8192, max_model_len=8192, target_itl_s=0.05, block_size=16
    )
    for num_tokens, attended in [(1, 100), (64, 2000), (256, 40000), (16, 64000), (512, 300000), (8, 1000)] * 3:
        # learned: 1 ms a step, 0.05 ms a token, 0.5 ms per thousand tokens attended
        sched.step_cost.observe(2, num_tokens, attended, 0.001 + 0.00005 * num_tokens + 0.0005 * attended / 1000)
    sched.add_request("decoding", PROMPT_A, greedy(200), 0.0)
    sched.update(step := sched.schedule(0.0), answer(step), 0.0)
    sched.add_request("long", list(range(1, 6001)), greedy(2), 0.0)
    chunk_sizes = []
    for _ in range(4):
        step = sched.schedule(0.0)
        chunk_sizes += [
            r.num_scheduled_tokens
            for r in step.output.new_requests + step.output.running_requests
            if r.num_scheduled_tokens > 1
        ]
        sched.update(step, answer(step), 0.0)
    assert len(chunk_sizes) == 4
    assert chunk_sizes[0] > chunk_sizes[1] > chunk_sizes[2] > chunk_sizes[3], chunk_sizes
