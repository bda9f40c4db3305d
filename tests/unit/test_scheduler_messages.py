"""What the scheduler sends: each request in full to the worker, and to the api replicas each token
with what the replica reports about the request (prompt and cached tokens, logprobs, the finish
reason, an error and its HTTP status), every plain token in its own replica's columns."""

from __future__ import annotations

from service.contract import wire
from service.scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig, build_scheduler
from tests.support.scheduler_harness import Harness, greedy

PREFIX = list(range(1, 9))  # two full blocks of 4


def config(**overrides) -> SchedulerConfig:
    values = dict(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    values.update(overrides)
    return SchedulerConfig(**values)


def result(step: ScheduledStep, token_id: int = 5, skip: tuple[str, ...] = (), **fields) -> wire.StepResult:
    """The worker's answer: `token_id` for every request of the step that samples (but those in `skip`)."""
    return wire.StepResult(
        step_id=step.step_id,
        sampled=[
            wire.SampledToken(r.request_id, token_id, **fields)
            for r in step.requests
            if r not in step.not_sampling and r.request_id not in skip
        ],
    )


def scheduler_with_a_cached_prefix() -> Scheduler:
    """A scheduler whose prefix cache holds PREFIX (8 tokens), computed for a request that has ended."""
    scheduler = build_scheduler(config())
    scheduler.add_request("first", [*PREFIX, 9], greedy(1), 0.0)
    step = scheduler.schedule(0.0)
    scheduler.update(step, result(step), 0.0)
    assert not scheduler.requests
    return scheduler


def test_a_request_goes_to_the_worker_in_full_the_first_time_and_again_after_a_preemption():
    harness = Harness(config(num_blocks=12, enable_prefix_caching=False))
    sampling = {"a": greedy(40, temperature=0.5, seed=3), "b": greedy(40, top_k=7)}
    harness.add("a", [1] * 4, sampling["a"])
    harness.add("b", [2] * 4, sampling["b"])
    output = harness.step()
    a = harness.scheduler.requests["a"]
    assert output.new_requests[0] == wire.NewRequest(
        request_id="a", token_ids=[1] * 4, num_prompt_tokens=4, sampling=sampling["a"],
        block_ids=harness.kv.block_ids(a), num_computed_tokens=0, num_scheduled_tokens=4,
    )  # fmt: skip
    victims = []
    while not victims:
        victims = harness.step().preempted_request_ids
    [victim_id] = victims
    victim = harness.scheduler.requests[victim_id]
    resumed = []
    while not resumed:
        token_ids = list(victim.token_ids)  # the prompt and the output so far
        resumed = [r for r in harness.step().new_requests if r.request_id == victim_id]
    assert len(token_ids) > 4 and resumed[0] == wire.NewRequest(
        request_id=victim_id, token_ids=token_ids, num_prompt_tokens=4, sampling=sampling[victim_id],
        block_ids=harness.kv.block_ids(victim), num_computed_tokens=0, num_scheduled_tokens=len(token_ids),
    )  # fmt: skip


def test_every_delta_tells_the_replica_the_request_s_prompt_and_cached_tokens_and_its_logprobs():
    """ "second" finds 8 of its 10 prompt tokens in the prefix cache; each of its deltas says so, with
    the token's logprob and top logprobs; an aborted request's closing delta too, with no error."""
    scheduler = scheduler_with_a_cached_prefix()
    scheduler.add_request("second", [*PREFIX, 20, 21], greedy(2, logprobs=2), 1.0, b"replica")
    scheduler.add_request("aborted", [*PREFIX, 30, 31], greedy(2), 1.0, b"replica")
    top = [wire.TokenLogprob(5, -0.5), wire.TokenLogprob(6, -1.5)]
    step = scheduler.schedule(1.0)
    deltas = scheduler.abort_request("aborted", 1.0).deltas[b"replica"]
    deltas += scheduler.update(step, result(step, logprob=-0.5, top_logprobs=top), 2.0).deltas[b"replica"]
    step = scheduler.schedule(2.0)
    deltas += scheduler.update(step, result(step, logprob=-0.5, top_logprobs=top), 3.0).deltas[b"replica"]
    token = dict(request_id="second", token_ids=[5], logprobs=[-0.5], top_logprobs=[top], num_prompt_tokens=10)
    assert deltas == [
        wire.RequestDelta(
            request_id="aborted", token_ids=[], finish_reason="abort", error=None, error_status=None,
            num_prompt_tokens=10, num_cached_tokens=8,
        ),
        wire.RequestDelta(**token, num_cached_tokens=8),
        wire.RequestDelta(**token, finish_reason="length", num_cached_tokens=8),
    ]  # fmt: skip


def test_a_worker_error_ends_the_step_s_requests_with_status_500():
    scheduler = build_scheduler(config())
    scheduler.add_request("a", [1, 2, 3], greedy(4), 0.0)
    step = scheduler.schedule(0.0)
    outcome = scheduler.update(step, wire.StepResult(step_id=step.step_id, error="boom"), 2.0)
    assert outcome.deltas[b""] == [
        wire.RequestDelta(
            request_id="a", token_ids=[], finish_reason="error", error="worker error: boom", error_status=500,
            num_prompt_tokens=3,
        )
    ]  # fmt: skip
    assert [r.finish_time for r in outcome.finished] == [2.0]


def test_a_request_the_worker_returned_no_token_for_ends_with_an_error_and_the_others_keep_theirs():
    scheduler = build_scheduler(config())
    for request_id in ("missing", "served", "also-served"):
        scheduler.add_request(request_id, [1, 2, 3], greedy(4), 0.0, b"replica")
    step = scheduler.schedule(0.0)
    outcome = scheduler.update(step, result(step, token_id=7, skip=("missing",)), 3.0)
    assert outcome.deltas[b"replica"] == [
        wire.RequestDelta(
            request_id="missing", token_ids=[], finish_reason="error", error="the worker returned no token",
            error_status=500, num_prompt_tokens=3,
        )
    ]  # fmt: skip
    assert [(r.request_id, r.finish_reason.value, r.finish_time) for r in outcome.finished] == [
        ("missing", "error", 3.0)
    ]
    assert outcome.tokens[b"replica"] == (["served", "also-served"], [7, 7])


def test_plain_tokens_stay_in_their_replica_s_columns_when_replicas_alternate_in_a_step():
    scheduler = build_scheduler(config())
    for request_id, owner in (("a1", b"a"), ("b1", b"b"), ("a2", b"a")):
        scheduler.add_request(request_id, [1, 2, 3], greedy(4), 0.0, owner)
    scheduler.add_request("default", [1, 2, 3], greedy(4), 0.0)  # no owner: the empty one
    step = scheduler.schedule(0.0)
    outcome = scheduler.update(step, result(step, token_id=7), 0.0)
    assert outcome.tokens == {b"a": (["a1", "a2"], [7, 7]), b"b": (["b1"], [7]), b"": (["default"], [7])}


def test_a_stop_token_ends_a_request_with_reason_stop_and_its_last_allowed_token_with_length():
    harness = Harness(config())
    harness.add("capped", [7, 8], greedy(3))
    harness.run_until_idle()
    stop_at = harness.outputs["capped"][1]
    harness.add("stopped", [7, 8], greedy(30, stop_token_ids=[stop_at]))
    harness.run_until_idle()
    assert harness.outputs["stopped"] == harness.outputs["capped"][: harness.outputs["capped"].index(stop_at) + 1]
    assert harness.finish_reasons == {"capped": "length", "stopped": "stop"}
