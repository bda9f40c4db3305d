"""The engine loop: the scheduler it builds for a worker that registers (the settings' limits, the
worker's table and model), the time it hands the scheduler, which results it accepts, and what
losing the worker ends."""

from __future__ import annotations

import time

import pytest

from service.contract import wire
from service.contract.config import Settings
from service.scheduler.counters import SchedulerCounters
from service.scheduler.engine import EngineLoop
from service.scheduler.kv_cache_manager import KVCacheManager
from service.scheduler.scheduler import DEFAULT_MAX_MODEL_LEN, SchedulerConfig, build_scheduler
from service.scheduler.split_table import SplitTableConfig, SplitTableKVCacheManager, split_table_config_from


def settings(**overrides) -> Settings:
    """Every setting the scheduler reads, none of them a default (the environment cannot change them)."""
    values = dict(
        block_size=32, num_kv_blocks=None, max_model_len=None, max_num_seqs=5, max_num_batched_tokens=96,
        enable_prefix_caching=False, preemption_policy="lifo", scheduling_policy="priority", priority_aging_s=7.5,
        target_itl_ms=40.0, async_scheduling=True, enable_v1_kvcache_scheduler=True, kv_cache_ratio=0.6,
        legacy_dec_blocks=3, legacy_disable_recover=True,
    )  # fmt: skip
    values.update(overrides)
    return Settings(**values)


def hello(num_kv_blocks: int = 200, max_model_len: int = 512) -> wire.WorkerHello:
    model = wire.ModelInfo(
        name="tiny", max_model_len=max_model_len, vocab_size=100, eos_token_ids=[2, 3], bos_token_id=1,
        tokenizer_json="{}", chat_template=None,
    )  # fmt: skip
    return wire.WorkerHello(worker_id="worker", num_kv_blocks=num_kv_blocks, block_size=8, model=model)


def expected_config(num_blocks: int, max_model_len: int) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=num_blocks, block_size=8, max_num_seqs=5, max_num_batched_tokens=96, max_model_len=max_model_len,
        enable_prefix_caching=False, preemption_policy="lifo", eos_token_ids=(2, 3), vocab_size=100,
        scheduling_policy="priority", priority_aging_s=7.5, target_itl_s=0.04,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("limits", "num_blocks", "max_model_len"),
    [
        (dict(), 200, 512),  # unset: the worker's table and model
        (dict(num_kv_blocks=150, max_model_len=256), 150, 256),  # below the worker's: the settings'
        (dict(num_kv_blocks=300, max_model_len=1024), 200, 512),  # above: the worker's
    ],
    ids=["unset", "lower", "higher"],
)
def test_a_registering_worker_gets_a_scheduler_of_its_table_and_model_within_the_settings(
    limits, num_blocks, max_model_len
):
    counters = SchedulerCounters()
    engine = EngineLoop.for_worker(settings(**limits), hello(), counters)
    assert engine.scheduler.config == expected_config(num_blocks, max_model_len)
    assert engine.scheduler.counters is counters
    assert engine.max_in_flight == 2
    assert type(engine.scheduler.kv) is KVCacheManager and engine.scheduler.kv.pool.num_blocks == num_blocks


def test_without_async_scheduling_one_step_is_in_flight_at_a_time():
    engine = EngineLoop.for_worker(settings(async_scheduling=False), hello(), SchedulerCounters())
    assert engine.max_in_flight == 1


def test_the_legacy_setting_gives_the_split_tables_of_the_settings_ratio_and_decode_blocks():
    legacy = settings(enable_v1_kvcache_scheduler=False)
    assert split_table_config_from(settings()) is None
    assert split_table_config_from(legacy) == SplitTableConfig(kv_cache_ratio=0.6, dec_blocks=3, disable_recover=True)
    engine = EngineLoop.for_worker(legacy, hello(num_kv_blocks=100), SchedulerCounters())
    kv = engine.scheduler.kv
    assert isinstance(kv, SplitTableKVCacheManager) and kv.split == split_table_config_from(legacy)
    assert kv.pool_usage() == [("prefill", 60, 0), ("decode", 40, 0)]


def test_scheduler_settings_without_a_model_length_or_a_latency_target_take_the_defaults():
    config = SchedulerConfig.from_settings(settings(target_itl_ms=0.0), 64)
    assert config.max_model_len == DEFAULT_MAX_MODEL_LEN and config.target_itl_s is None
    assert config.num_blocks == 64 and config.block_size == 32 and config.max_num_seqs == 5
    assert SchedulerConfig.from_settings(settings(), 64, block_size=4).block_size == 4  # overrides win


def test_the_unified_table_reports_one_pool_of_its_capacity_and_the_blocks_held():
    scheduler = build_scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    scheduler.add_request("a", [1] * 9, wire.SamplingParams(max_tokens=2), 0.0)
    scheduler.schedule(0.0)
    assert scheduler.kv.pool_usage() == [("unified", 16, 3)]


def test_the_loop_hands_the_scheduler_the_time_it_is_given_and_times_schedule_itself():
    loop = EngineLoop(build_scheduler(SchedulerConfig(num_blocks=16, block_size=4)), overlapped=False)
    loop.scheduler.add_request("a", [1, 2, 3], wire.SamplingParams(max_tokens=5), 1.0)
    sent = []
    started = time.perf_counter()
    loop.run(5.0, sent.append)
    elapsed = time.perf_counter() - started
    [step] = sent
    assert 0.0 <= step.schedule_s <= elapsed
    request = loop.scheduler.requests["a"]
    assert request.first_scheduled_time == 5.0
    outcome = loop.complete(wire.StepResult(step_id=step.step_id, sampled=[wire.SampledToken("a", 9)]), 6.0)
    assert outcome.first_tokens == [request] and request.first_token_time == 6.0
    loop.run(6.0, sent.append)
    outcome = loop.fail("the worker is gone", 7.0)
    assert outcome.finished == [request] and request.finish_time == 7.0 and not loop.in_flight
    assert [(d.error, d.error_status) for d in outcome.all_deltas()] == [("the worker is gone", 503)]


def test_a_result_for_a_step_that_is_not_the_oldest_in_flight_is_ignored():
    loop = EngineLoop(build_scheduler(SchedulerConfig(num_blocks=16, block_size=4)), overlapped=True)
    assert loop.complete(wire.StepResult(step_id=1), 0.0) is None  # nothing in flight
    loop.scheduler.add_request("a", [1, 2, 3], wire.SamplingParams(max_tokens=5), 0.0)
    loop.run(0.0, lambda step: None)
    first, second = loop.in_flight
    assert loop.complete(wire.StepResult(step_id=second.step_id, sampled=[wire.SampledToken("a", 9)]), 1.0) is None
    assert list(loop.in_flight) == [first, second] and loop.scheduler.requests["a"].token_ids == [1, 2, 3]
