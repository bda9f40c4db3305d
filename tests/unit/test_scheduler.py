from collections import deque

import pytest

from service.contract import wire
from service.contract.block_hashes import extend_block_hashes
from service.scheduler.engine import EngineLoop
from service.scheduler.preemption import lifo, min_recompute
from service.scheduler.request import RequestStatus
from service.scheduler.scheduler import RequestRejected, SchedulerConfig, build_scheduler
from service.scheduler.split_table import SplitTableConfig
from service.tools.fake_worker import FakeWorker
from tests.support.scheduler_harness import Harness, greedy, reference_output


def config(**overrides):
    values = dict(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    values.update(overrides)
    return SchedulerConfig(**values)


MODES = pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])


@MODES
@pytest.mark.parametrize("policy", ["lifo", "min_recompute"])
def test_preempted_request_resumes_with_identical_output(policy, overlapped):
    cfg = config(num_blocks=12, preemption_policy=policy, enable_prefix_caching=False)
    harness = Harness(cfg, overlapped=overlapped)
    prompts = {f"r{i}": [10 + i] * 6 for i in range(4)}
    for request_id, prompt in prompts.items():
        harness.add(request_id, prompt, greedy(30))
    harness.run_until_idle()
    stats = harness.scheduler.counters
    assert stats.num_preemptions > 0
    assert stats.num_recomputed_tokens > 0
    for request_id, prompt in prompts.items():
        assert harness.outputs[request_id] == reference_output(prompt, greedy(30), cfg)
    assert harness.kv.pool.num_free_blocks == cfg.num_blocks


class RecomputeLedger(Harness):
    """The harness, keeping from the steps it sends (the worker's view) what each request recomputes: the
    tokens it had computed before its latest preemption, scheduled again. At every admission it checks that
    the request starts after the longest run of its leading full blocks in the prefix cache when it was looked
    up (the last token always recomputed)."""

    def __init__(self, cfg: SchedulerConfig, overlapped: bool):
        super().__init__(cfg, overlapped=overlapped)
        self.computed: dict[str, int] = {}  # tokens the steps so far computed for each request since its admission
        self.before_preemption: dict[str, int] = {}  # most tokens it had computed before a preemption
        self.recomputed_tokens = 0
        # Per resumption: (tokens found cached, tokens of full blocks it had computed and could have found).
        self.resumed_from: list[tuple[int, int]] = []
        self.cached_at_lookup: dict[str, set[int]] = {}  # the prefix cache's hashes when a request's was looked up
        look_up = self.kv.get_computed_blocks

        def cache_seen_by(request):
            self.cached_at_lookup[request.request_id] = set(self.kv.pool.cached_hashes())
            return look_up(request)

        self.kv.get_computed_blocks = cache_seen_by

    def send(self, step):
        output = super().send(step)
        block_size = self.config.block_size
        for request_id in output.preempted_request_ids:
            self.before_preemption[request_id] = max(
                self.before_preemption.get(request_id, 0), self.computed[request_id]
            )
        for new in output.new_requests:
            cached = self.cached_at_lookup.pop(new.request_id)
            hashes: list[int] = []
            extend_block_hashes(hashes, new.token_ids, block_size)
            cached_run = next(
                (index for index, block_hash in enumerate(hashes) if block_hash not in cached), len(hashes)
            )
            assert new.num_computed_tokens == min(cached_run, (len(new.token_ids) - 1) // block_size) * block_size
            if new.request_id in self.before_preemption:
                before = min(self.before_preemption[new.request_id], len(new.token_ids) - 1)
                self.resumed_from.append((new.num_computed_tokens, before // block_size * block_size))
            self.computed[new.request_id] = new.num_computed_tokens
        for chunk in output.new_requests + output.running_requests:
            start = self.computed[chunk.request_id]
            end = self.computed[chunk.request_id] = start + chunk.num_scheduled_tokens
            self.recomputed_tokens += max(0, min(end, self.before_preemption.get(chunk.request_id, 0)) - start)
        return output


@MODES
def test_resumed_request_recomputes_only_evicted_blocks(overlapped):
    """A preempted request resumes after every block of its prefix still cached: what it computes again is
    exactly what it had computed beyond them (evicted blocks, and a tail that filled no block)."""
    cfg = config(num_blocks=12, preemption_policy="lifo")
    harness = RecomputeLedger(cfg, overlapped)
    for i in range(4):
        harness.add(f"r{i}", [10 + i] * 6, greedy(30))
    harness.run_until_idle()

    stats = harness.scheduler.counters
    assert stats.num_preemptions > 0 and len(harness.resumed_from) == stats.num_preemptions
    assert stats.num_recomputed_tokens == harness.recomputed_tokens
    assert any(cached > 0 for cached, _ in harness.resumed_from), "no resumption found blocks still cached"
    assert any(cached < computed for cached, computed in harness.resumed_from), "no resumption lost blocks"
    for i in range(4):
        assert harness.outputs[f"r{i}"] == reference_output([10 + i] * 6, greedy(30), cfg)


def test_shared_prefix_requests_share_blocks_and_count_hits():
    harness = Harness(config())
    prefix = list(range(1, 17))  # four full blocks
    harness.add("first", prefix + [40, 41], greedy(4))
    harness.step()
    harness.add("second", prefix + [50], greedy(4))
    output = harness.step()
    [second] = [r for r in output.new_requests if r.request_id == "second"]
    first_blocks = harness.kv.block_ids(harness.scheduler.requests["first"])
    assert second.num_computed_tokens == 16
    assert second.block_ids[:4] == first_blocks[:4]
    assert all(harness.kv.pool.blocks[b].ref_count == 2 for b in first_blocks[:4])
    assert harness.scheduler.counters.prefix_cache_hits == 16
    harness.run_until_idle()
    assert harness.outputs["second"] == reference_output(prefix + [50], greedy(4), harness.config)


def test_last_prompt_token_is_always_recomputed():
    harness = Harness(config())
    prompt = list(range(1, 17))  # exactly four blocks
    harness.add("a", prompt, greedy(2))
    harness.run_until_idle()
    harness.add("b", prompt, greedy(2))
    output = harness.step()
    assert output.new_requests[0].num_computed_tokens == 12
    assert output.new_requests[0].num_scheduled_tokens == 4
    harness.run_until_idle()
    assert harness.outputs["b"] == harness.outputs["a"]


def test_chunked_prefill_respects_the_token_budget():
    harness = Harness(config(max_num_batched_tokens=8, max_model_len=64, num_blocks=16))
    harness.add("long", list(range(1, 31)), greedy(3))
    scheduled = [harness.step().num_scheduled_tokens for _ in range(4)]
    assert scheduled == [8, 8, 8, 6]
    assert harness.outputs["long"] != []  # the first token came with the last chunk only
    assert len(harness.outputs["long"]) == 1


def test_running_requests_are_sent_as_deltas_only():
    harness = Harness(config())
    harness.add("a", [1, 2, 3], greedy(8))
    first = harness.step()
    assert [r.request_id for r in first.new_requests] == ["a"]
    second = harness.step()
    assert second.new_requests == []
    assert second.running_requests == [wire.RunningRequest("a", [], 1)]  # position 3 still fits block 0
    third = harness.step()
    assert third.running_requests == [
        wire.RunningRequest("a", [harness.kv.block_ids(harness.scheduler.requests["a"])[1]], 1)
    ]


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "message"),
    [(64, 1, "max_model_len"), (70, 1, "max_model_len"), (10, 60, "whole cache holds 8")],
)
def test_request_that_can_never_fit_is_rejected(prompt_len, max_tokens, message):
    harness = Harness(config(num_blocks=8))
    with pytest.raises(RequestRejected, match=message):
        harness.add("big", [1] * prompt_len, greedy(max_tokens))
    assert harness.scheduler.requests == {}


def test_token_ids_outside_the_vocabulary_are_rejected():
    harness = Harness(config(vocab_size=100))
    for prompt in ([1, 100], [-1, 5]):
        with pytest.raises(RequestRejected, match=r"\[0, 100\)"):
            harness.add("bad", prompt, greedy(2))
    harness.add("good", [1, 99], greedy(2))
    harness.run_until_idle()
    assert len(harness.outputs["good"]) == 2


def test_head_that_cannot_fit_lets_smaller_requests_pass_then_ages():
    cfg = config(num_blocks=16, max_head_skips=3, max_model_len=128)
    harness = Harness(cfg)
    harness.add("running", [1] * 20, greedy(40))  # holds 5 blocks and grows
    harness.step()
    harness.add("head", [2] * 44, greedy(1))  # needs 11 blocks: cannot fit beside "running"
    harness.add("small", [3] * 3, greedy(1))
    harness.step()
    assert harness.scheduler.requests["head"].status is RequestStatus.WAITING
    assert "small" not in harness.scheduler.requests  # passed the head and finished
    for _ in range(4):
        harness.step()
    harness.add("late", [4] * 3, greedy(1))
    harness.step()
    assert harness.scheduler.requests["late"].status is RequestStatus.WAITING  # the aged head blocks it
    harness.run_until_idle()
    assert len(harness.outputs["head"]) == 1


def test_abort_frees_blocks_and_tells_the_worker():
    harness = Harness(config())
    harness.add("a", [1, 2, 3, 4, 5], greedy(20))
    harness.step()
    harness.abort("a")
    assert harness.kv.pool.num_free_blocks == 16
    assert harness.finish_reasons["a"] == "abort"
    assert harness.step().finished_request_ids == ["a"]
    assert "a" not in harness.worker.requests


def test_abort_while_a_step_computes_it_frees_its_blocks_at_once_and_drops_that_steps_token():
    """The worker runs steps in order, so the freed blocks can go to another request at once: the
    step that takes them writes them only after the step in flight has finished with them."""
    harness = Harness(config(num_blocks=4), overlapped=True)
    harness.add("a", [1, 2, 3, 4, 5], greedy(10))
    harness.step()  # steps 1 and 2 sent, step 1 computed: step 2 (a decode of "a") is in flight
    tokens_before = list(harness.outputs["a"])
    harness.abort("a")
    assert harness.finish_reasons["a"] == "abort"
    assert harness.kv.pool.num_free_blocks == 4
    prompt = list(range(6, 21))
    harness.add("b", prompt, greedy(1))  # needs every block
    harness.step()  # step 2 returns: its token for "a" is dropped; step 3 gives "b" the blocks "a" had
    assert harness.outputs["a"] == tokens_before
    assert harness.scheduler.counters.num_wasted_decode_slots == 1
    harness.run_until_idle()
    assert harness.outputs["b"] == reference_output(prompt, greedy(1), harness.config)
    assert "a" not in harness.worker.requests
    assert harness.kv.pool.num_free_blocks == 4


@MODES
def test_stop_token_sampled_while_the_next_step_is_in_flight_ends_the_request_there(overlapped):
    cfg = config()
    plain = reference_output([7, 8], greedy(30), cfg)
    harness = Harness(cfg, overlapped=overlapped)
    harness.add("stopped", [7, 8], greedy(30, stop_token_ids=[plain[4]]))
    harness.add("capped", [9, 9], greedy(3))
    harness.run_until_idle()
    assert harness.outputs["stopped"] == plain[:5]  # nothing past the stop token
    assert harness.outputs["capped"] == reference_output([9, 9], greedy(3), cfg)
    # The overlapped loop computed one token past the stop; max_tokens is known ahead, so no slot is lost there.
    assert harness.scheduler.counters.num_wasted_decode_slots == int(overlapped)
    assert harness.kv.pool.num_free_blocks == cfg.num_blocks


def test_overlapped_loop_keeps_two_steps_in_flight_and_schedules_decodes_ahead():
    harness = Harness(config(), overlapped=True)
    harness.add("a", [1, 2, 3], greedy(5))
    first = harness.step()
    assert len(harness.loop.in_flight) == 1  # step 2 waits at the worker while step 1 was computed
    [second] = harness.loop.in_flight
    assert first.new_requests[0].num_scheduled_tokens == 3
    assert second.output.running_requests == [wire.RunningRequest("a", [], 1)]  # the token step 1 samples
    harness.run_until_idle()
    assert harness.outputs["a"] == reference_output([1, 2, 3], greedy(5), harness.config)
    assert harness.steps == 5  # one step per token: no extra step for the last, known in advance


@MODES
def test_an_errored_step_ends_its_requests_and_frees_their_slots(overlapped):
    harness = Harness(config(max_num_seqs=1), overlapped=overlapped)
    harness.add("a", [1, 2, 3], greedy(10))
    harness.loop.run(harness.now, harness.send)
    first = harness.to_worker.popleft()
    harness.worker.execute(first)  # computed, but the worker reports an error instead of its tokens
    harness.record(harness.loop.complete(wire.StepResult(step_id=first.step_id, error="boom"), 1.0))
    assert harness.errors["a"] == "worker error: boom"
    assert not harness.scheduler.running and harness.kv.pool.num_free_blocks == 16
    harness.add("b", [4, 5], greedy(3))  # one slot: "b" runs only if "a" gave it back
    harness.run_until_idle(max_steps=20)
    assert harness.outputs["b"] == reference_output([4, 5], greedy(3), harness.config)


def _running(harness, request_id):
    return harness.scheduler.requests[request_id]


def test_victim_policies_choose_newest_or_cheapest():
    harness = Harness(config(num_blocks=32, max_model_len=64))
    harness.add("old_long", [1] * 20, greedy(20))
    harness.step()
    harness.add("new_short", [2] * 3, greedy(20))
    harness.step()
    harness.add("newest_long", [3] * 24, greedy(20))
    harness.step()
    candidates = [_running(harness, "new_short"), _running(harness, "newest_long")]
    assert lifo(candidates, harness.kv).request_id == "newest_long"
    assert min_recompute(candidates, harness.kv).request_id == "new_short"


def split_table_harness(ratio=0.5, disable_recover=False, overlapped=False, **overrides):
    return Harness(
        config(**overrides),
        SplitTableConfig(kv_cache_ratio=ratio, dec_blocks=1, disable_recover=disable_recover),
        overlapped,
    )


@MODES
def test_split_table_suspends_the_request_with_most_decode_blocks_and_recovers_it(overlapped):
    harness = split_table_harness(num_blocks=16, overlapped=overlapped)  # 8 prefill + 8 decode blocks of 4 tokens
    prompts = {f"r{i}": [20 + i] * 3 for i in range(4)}  # each takes 2 prefill blocks, then grows
    for request_id, prompt in prompts.items():
        harness.add(request_id, prompt, greedy(16))
    harness.run_until_idle()
    assert harness.scheduler.counters.num_preemptions > 0
    assert harness.scheduler.counters.num_recomputed_tokens > 0
    for request_id, prompt in prompts.items():
        assert harness.outputs[request_id] == reference_output(prompt, greedy(16), harness.config)
    assert harness.errors == {}


@MODES
def test_split_table_without_recovery_ends_suspended_requests_incomplete(overlapped):
    harness = split_table_harness(num_blocks=16, disable_recover=True, overlapped=overlapped)
    for i in range(4):
        harness.add(f"r{i}", [20 + i] * 3, greedy(16))
    harness.run_until_idle()
    assert harness.errors and all(e.startswith("incomplete") for e in harness.errors.values())
    assert len(harness.errors) < 4  # the others finished
    assert harness.kv.pool.num_free_blocks == 16


def test_split_table_rejects_a_prompt_larger_than_the_prefill_share():
    harness = split_table_harness(ratio=0.3, num_blocks=16)  # 4 prefill blocks of 4 tokens
    with pytest.raises(RequestRejected, match="KV_CACHE_RATIO=0.3"):
        harness.add("long", [1] * 14, greedy(2))


def test_split_table_head_of_line_waits_for_prefill_blocks():
    harness = split_table_harness(ratio=0.5, num_blocks=16)
    harness.add("a", [1] * 10, greedy(30))  # 4 prefill blocks incl. one decode block
    harness.add("b", [2] * 10, greedy(30))  # 4 more: the prefill share is full
    harness.add("c", [3], greedy(1))  # would fit the unified table, not the prefill share
    harness.step()
    assert harness.scheduler.requests["c"].status is RequestStatus.WAITING
    harness.run_until_idle()
    assert len(harness.outputs["c"]) == 1


def test_split_table_request_ended_inside_schedule_reports_at_once_even_if_the_step_is_empty():
    cfg = config(num_blocks=16, max_model_len=64)
    scheduler = build_scheduler(cfg, SplitTableConfig(kv_cache_ratio=0.9, dec_blocks=1))  # decode table: 2 blocks
    loop = EngineLoop(scheduler, overlapped=False)
    worker = FakeWorker(16, cfg.block_size)
    scheduler.add_request("long", [1, 2, 3], greedy(30), 0.0)  # needs 7 decode blocks: can never finish
    steps = []
    while scheduler.has_work:  # as the server does: schedule while there is work, update only after a real step
        loop.run(0.0, steps.append)
        if loop.in_flight:
            loop.complete(worker.execute(steps[-1].output), 0.0)
    ended = [delta for step in steps for delta in step.outcome.all_deltas()]
    for step in steps:
        assert [r.request_id for r in step.outcome.finished] == [d.request_id for d in step.outcome.all_deltas()]
    assert steps[-1].output.is_empty and [d.request_id for d in ended] == ["long"]
    assert ended[0].error.startswith("incomplete") and scheduler.requests == {}
    assert scheduler.kv.pool.num_free_blocks == 16


def test_plain_tokens_go_to_each_replica_as_columns_and_the_rest_as_deltas():
    scheduler = build_scheduler(config())
    scheduler.add_request("plain", [1, 2, 3], greedy(3), 0.0, b"replica-a")
    scheduler.add_request("with-logprobs", [4, 5, 6], greedy(3, logprobs=1), 0.0, b"replica-a")
    scheduler.add_request("other-replica", [7, 8, 9], greedy(3), 0.0, b"replica-b")
    batches_per_step = []
    while scheduler.has_work:
        step = scheduler.schedule(0.0)
        if not step.needs_result:
            continue  # only the ended requests' ids for the worker
        sampled = [
            wire.SampledToken(r, 11 + step.step_id, logprob=-0.5 if r == "with-logprobs" else None)
            for r in [n.request_id for n in step.output.new_requests]
            + [n.request_id for n in step.output.running_requests]
        ]
        outcome = scheduler.update(step, wire.StepResult(step_id=step.step_id, sampled=sampled), 0.0)
        batches_per_step.append(outcome.batches())
    first, middle, last = batches_per_step
    # The first token of each request carries its timing: a delta; then plain tokens are columns.
    assert middle[b"replica-a"].token_request_ids == ["plain"] and middle[b"replica-a"].token_ids == [13]
    assert [d.request_id for d in middle[b"replica-a"].deltas] == ["with-logprobs"]
    assert middle[b"replica-a"].deltas[0].logprobs == [-0.5]
    assert middle[b"replica-b"].token_request_ids == ["other-replica"] and middle[b"replica-b"].deltas == []
    # The last token ends the request: a delta with its finish reason, never a column.
    assert all(batch.token_request_ids == [] for batch in last.values())
    assert {d.request_id: d.finish_reason for batch in last.values() for d in batch.deltas} == {
        "plain": "length",
        "with-logprobs": "length",
        "other-replica": "length",
    }
    outputs = {}
    for batches in batches_per_step:
        for batch in wire.decode(wire.encode(batches[b"replica-a"])).all_deltas():
            outputs.setdefault(batch.request_id, []).extend(batch.token_ids)
    assert outputs == {"plain": [12, 13, 14], "with-logprobs": [12, 13, 14]}


@MODES
def test_a_worker_that_outlives_a_lost_scheduler_drops_the_old_requests_when_a_new_one_starts(overlapped):
    """The server declares a worker lost on a ping timeout while the worker process lives on; it says
    hello again and gets a new scheduler, whose first step tells it to drop what it still holds."""
    cfg = config()
    worker = FakeWorker(cfg.num_blocks, cfg.block_size)
    lost = EngineLoop(build_scheduler(cfg), overlapped)
    lost.scheduler.add_request("old", [1, 2, 3], greedy(10), 0.0)
    steps = []
    lost.run(0.0, steps.append)
    worker.execute(steps[0].output)
    assert "old" in worker.requests
    assert [d.error for d in lost.fail("the worker did not answer pings", 1.0).all_deltas()] == [
        "the worker did not answer pings"
    ]

    new = EngineLoop(build_scheduler(cfg), overlapped)
    new.scheduler.add_request("fresh", [4, 5], greedy(2), 2.0)
    to_worker = deque()
    new.run(2.0, lambda step: to_worker.append(step.output))
    assert to_worker[0].reset and not any(output.reset for output in list(to_worker)[1:])
    while to_worker:
        output = to_worker.popleft()
        result = worker.execute(output)
        if not output.is_empty:
            new.complete(result, 2.0)
        new.run(2.0, lambda step: to_worker.append(step.output))
    assert worker.requests == {}  # "fresh" ended and was dropped; "old" went with the first step


def test_a_suspended_split_table_request_counts_as_running_not_as_waiting():
    harness = split_table_harness(num_blocks=16)
    for i in range(4):
        harness.add(f"r{i}", [20 + i] * 3, greedy(16))
    while harness.scheduler.counters.num_preemptions == 0:
        harness.step()
    assert len(harness.scheduler.running) == 4 and not harness.scheduler.waiting  # the suspended one keeps its seat
    assert harness.scheduler.num_preempted_waiting == 0
    harness.run_until_idle()
