"""How a scheduler is set up and what it lets in: the status and sentence of each rejection, the
settings it is built from, the split-table baseline's fcfs admission and its counters, fcfs
ignoring priorities, and the queue order a passed-over head keeps."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.contract.config import Settings
from service.scheduler.counters import SchedulerCounters
from service.scheduler.metrics import SchedulerMetrics
from service.scheduler.scheduler import (
    DEFAULT_MAX_MODEL_LEN,
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    build_scheduler,
)
from service.scheduler.split_table import SplitTableConfig
from service.tools.fake_worker import FakeWorker
from tests.support.scheduler_harness import VOCAB_SIZE, Harness, greedy

BLOCK_SIZE = 4


def small_config(**overrides) -> SchedulerConfig:
    values = dict(num_blocks=16, block_size=BLOCK_SIZE, max_num_batched_tokens=64, max_model_len=64)
    values.update(overrides)
    return SchedulerConfig(**values)


def samples(metrics: SchedulerMetrics) -> dict[tuple, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def settings(**overrides) -> Settings:
    """Every setting a SchedulerConfig reads, none of them a default (the environment cannot change them)."""
    values = dict(
        block_size=BLOCK_SIZE, max_model_len=None, max_num_seqs=8, max_num_batched_tokens=64,
        enable_prefix_caching=True, preemption_policy="lifo", scheduling_policy="fcfs", priority_aging_s=60.0,
        target_itl_ms=0.0,
    )  # fmt: skip
    values.update(overrides)
    return Settings(**values)


def drive_until_idle(scheduler: Scheduler, num_blocks: int) -> list:
    """Serial steps against the fake worker until nothing is left; the requests that finished."""
    worker, finished, now = FakeWorker(num_blocks, scheduler.config.block_size, VOCAB_SIZE), [], 0.0
    for _ in range(1000):
        if not scheduler.has_work:
            return finished
        step = scheduler.schedule(now)
        finished += step.outcome.finished
        result = worker.execute(step.output)
        if step.needs_result:
            now += 1.0
            finished += scheduler.update(step, result, now).finished
    raise AssertionError("no progress")


# ------------------------------------------------------------------ rejections


def test_a_duplicate_request_id_is_rejected_as_a_conflict_naming_the_id():
    scheduler = build_scheduler(small_config())
    scheduler.add_request("twice", [1, 2, 3], greedy(2), 0.0)
    with pytest.raises(RequestRejected) as rejected:
        scheduler.add_request("twice", [4, 5, 6], greedy(2), 0.0)
    assert rejected.value.status == 409
    assert str(rejected.value) == "request id 'twice' is already in use"
    assert list(scheduler.requests) == ["twice"]


@pytest.mark.parametrize(
    ("prompt", "sampling", "priority", "message"),
    [
        ([1, 2], greedy(2, temperature=-1.0), 0, "temperature must be a finite number"),
        ([1, 2], greedy(2), 2**31, "priority must lie in"),
        ([1, 2], greedy(2, stop_token_ids=[VOCAB_SIZE]), 0, f"stop token ids must lie in [0, {VOCAB_SIZE})"),
        ([1, 2], greedy(2, logit_bias={VOCAB_SIZE: 1.0}), 0, "logit_bias token ids must lie in"),
    ],
    ids=["bad-sampling", "priority-out-of-range", "stop-id-past-the-vocabulary", "bias-id-past-the-vocabulary"],
)
def test_a_request_that_could_never_be_served_is_rejected_as_a_bad_request(prompt, sampling, priority, message):
    """Each check applies on its own, sampling token ids against the model's vocabulary; the answer is a 400."""
    scheduler = build_scheduler(small_config(vocab_size=VOCAB_SIZE))
    with pytest.raises(RequestRejected) as rejected:
        scheduler.add_request("r", prompt, sampling, 0.0, priority=priority)
    assert rejected.value.status == 400
    assert message in str(rejected.value)
    assert not scheduler.requests and not scheduler.waiting


# ------------------------------------------------------------------ set up from settings


def test_from_settings_takes_the_settings_context_length_or_the_default_when_unset():
    assert SchedulerConfig.from_settings(settings(max_model_len=40), 16).max_model_len == 40
    assert SchedulerConfig.from_settings(settings(max_model_len=None), 16).max_model_len == DEFAULT_MAX_MODEL_LEN


def test_from_settings_context_length_decides_which_prompts_are_rejected():
    scheduler = build_scheduler(SchedulerConfig.from_settings(settings(max_model_len=40), 16))
    with pytest.raises(RequestRejected, match="the maximum context length \\(max_model_len\\) is 40"):
        scheduler.add_request("long", [1] * 40, greedy(2), 0.0)
    scheduler.add_request("fits", [1] * 39, greedy(2), 0.0)


def test_a_fresh_scheduler_shows_its_whole_token_budget_as_the_prefill_budget():
    """Scraped before any step: the gauge reads the token budget (no step has limited it yet)."""
    scheduler = build_scheduler(small_config(max_num_batched_tokens=48, target_itl_s=0.05))
    metrics = SchedulerMetrics(lambda: scheduler, scheduler.counters, lambda: "m", {})
    assert samples(metrics)[("blockserve_step_prefill_budget_tokens", (("model_name", "m"),))] == 48


# ------------------------------------------------------------------ fcfs ignores priorities


def test_fcfs_counts_every_request_in_the_default_priority_class():
    """Under fcfs the priority field is ignored, in the metrics' priority classes too."""
    harness = Harness(small_config(scheduling_policy="fcfs"))
    for request_id, priority in [("urgent", -3), ("plain", 0), ("lazy", 5)]:
        harness.add(request_id, [1, 2, 3], greedy(2), priority=priority)
    requests = list(harness.scheduler.requests.values())
    harness.run_until_idle()
    metrics = SchedulerMetrics(lambda: harness.scheduler, harness.scheduler.counters, lambda: "m", {})
    metrics.start_series("m")
    metrics.on_finished(requests)
    counts = {
        label: samples(metrics)[
            ("blockserve_request_preemptions_count", (("model_name", "m"), ("priority_class", label)))
        ]
        for label in ("high", "default", "low")
    }
    assert counts == {"high": 0, "default": 3, "low": 0}


def test_fcfs_protects_the_longest_running_request_whatever_its_priority_field():
    """Two requests outgrow the table; under fcfs the later one gives way, though it asked for a better
    priority (the field counts only under the priority policy)."""
    config = small_config(num_blocks=6, max_num_seqs=2, preemption_policy="lifo")
    harness = Harness(config)
    harness.add("first", [1] * 4, greedy(16), priority=0)
    harness.add("second", [2] * 4, greedy(16), priority=-1)
    harness.run_until_idle(max_steps=200)
    assert harness.preempted and set(harness.preempted) == {"second"}


# ------------------------------------------------------------------ the queue order under fcfs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_head_that_does_not_fit_keeps_its_place_ahead_of_later_arrivals(policy):
    """`big` arrives with two small ones but does not fit beside `holder`; `small-1` goes past it to the
    only free seat. When `holder` ends, its seat goes to `big`, the earlier arrival, not to `small-2`.
    Under `priority` the three have equal keys (same priority, same arrival): first come, first served,
    also for a request put back after being passed over."""
    config = small_config(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=64, scheduling_policy=policy)
    harness = Harness(config)
    harness.add("holder", [1] * 40, greedy(2))
    harness.step()
    for request_id, prompt, max_tokens in [("big", [2] * 24, 2), ("small-1", [3] * 4, 8), ("small-2", [4] * 4, 2)]:
        harness.add(request_id, prompt, greedy(max_tokens))
    harness.run_until_idle(max_steps=200)
    assert harness.admitted == ["holder", "small-1", "big", "small-2"]


# ------------------------------------------------------------------ the split-table baseline


def test_split_table_admits_first_come_first_served_without_skipping_a_head_that_does_not_fit():
    """v0 has no skip-ahead: `small` waits behind `big` (which lacks prefill blocks while `holder` runs),
    though it would fit."""
    config = small_config(num_blocks=16)  # 12 prefill blocks, 4 decode blocks
    harness = Harness(config, SplitTableConfig(kv_cache_ratio=0.75, dec_blocks=2))
    harness.add("holder", [1] * 24, greedy(2))  # 8 prefill blocks
    harness.add("big", [2] * 12, greedy(2))  # 5 prefill blocks: 4 are left
    harness.add("small", [3] * 4, greedy(2))  # 3 prefill blocks
    first = harness.step()
    assert [new.request_id for new in first.new_requests] == ["holder"]
    harness.run_until_idle()
    assert set(harness.finish_reasons) == {"holder", "big", "small"}


def test_split_table_ignores_priorities_even_when_the_config_asks_for_them():
    """The baseline is v0's: first come, first served, whatever scheduling_policy says."""
    harness = Harness(small_config(max_num_seqs=1, scheduling_policy="priority"), SplitTableConfig())
    harness.add("lazy", [1] * 4, greedy(2), priority=5)
    harness.add("urgent", [2] * 4, greedy(2), priority=-5)
    harness.run_until_idle(max_steps=100)
    assert harness.admitted == ["lazy", "urgent"]


def test_split_table_scheduler_counts_into_the_counters_it_is_given():
    """The engine's counters are the ones the metrics read: the split-table scheduler must keep them."""
    counters = SchedulerCounters()
    config = small_config(num_blocks=16)
    scheduler = build_scheduler(config, SplitTableConfig(), counters)
    scheduler.add_request("r", [1] * 6, greedy(3), 0.0)
    finished = drive_until_idle(scheduler, config.num_blocks)
    assert [request.request_id for request in finished] == ["r"]
    assert (counters.num_prompt_tokens, counters.num_generation_tokens) == (6, 3)
    assert counters.finished_by_reason["length"] == 1
