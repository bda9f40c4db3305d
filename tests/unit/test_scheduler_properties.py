"""Invariants of the scheduler, unified and split-table, over random traces (hypothesis)."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.contract import wire
from service.scheduler.scheduler import SchedulerConfig
from service.scheduler.split_table import SplitTableConfig
from tests.support.scheduler_harness import EOS_TOKEN_ID, Harness, reference_output

configs = st.builds(
    SchedulerConfig,
    num_blocks=st.integers(8, 32),
    block_size=st.sampled_from([2, 4, 8]),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(8, 64),
    max_model_len=st.integers(24, 96),
    enable_prefix_caching=st.booleans(),
    preemption_policy=st.sampled_from(["lifo", "min_recompute"]),
    eos_token_ids=st.just((EOS_TOKEN_ID,)),
    scheduling_policy=st.sampled_from(["fcfs", "priority", "fair"]),
    tenant_max_running=st.sampled_from([0, 0, 1, 3]),
    priority_aging_s=st.sampled_from([1.0, 4.0, 100.0]),
)

request_specs = st.fixed_dictionaries(
    {
        "shared_prefix": st.sampled_from([0, 1, 1, 2, 2]),  # a few common prefixes: prefix-cache hits
        "prompt": st.lists(st.integers(1, 63), min_size=1, max_size=24),
        "max_tokens": st.integers(1, 48),
        "ignore_eos": st.booleans(),
        "arrival_step": st.integers(0, 30),
        "abort_after": st.one_of(st.none(), st.integers(0, 40)),
        "priority": st.integers(-2, 2),
        "tenant": st.sampled_from([("a", 1.0), ("b", 2.0), ("c", 1.0)]),
    }
)

PREFIXES = [[], list(range(5, 21)), list(range(21, 45))]


def fits_alone(prompt, sampling, config):
    if len(prompt) >= config.max_model_len:
        return False
    max_len = min(len(prompt) + sampling.max_tokens, config.max_model_len)
    return -(-(max_len - 1) // config.block_size) <= config.num_blocks


MODES = pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
# Examples of the random-trace property; scripts/mutation.sh runs every mutant with fewer.
EXAMPLES = int(os.environ.get("BLOCKSERVE_PROPERTY_EXAMPLES", "300"))


@MODES
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, specs=st.lists(request_specs, min_size=1, max_size=14))
def test_random_traces_keep_every_invariant_and_finish_every_request(overlapped, config, specs):
    harness = Harness(config, overlapped=overlapped)
    expected, rejected, aborted = {}, set(), set()
    arrivals = sorted(enumerate(specs), key=lambda item: item[1]["arrival_step"])
    step = 0
    while arrivals or harness.scheduler.requests:
        while arrivals and arrivals[0][1]["arrival_step"] <= step:
            index, spec = arrivals.pop(0)
            request_id = f"r{index}"
            prompt = PREFIXES[spec["shared_prefix"]] + spec["prompt"]
            sampling = wire.SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"])
            if not fits_alone(prompt, sampling, config):
                try:
                    harness.add(request_id, prompt, sampling, spec["priority"], *spec["tenant"])
                except ValueError:
                    rejected.add(request_id)
                    continue
                raise AssertionError("a request that can never fit was queued")
            harness.add(request_id, prompt, sampling, spec["priority"], *spec["tenant"])
            expected[request_id] = (reference_output(prompt, sampling, config), spec["abort_after"], step)
        for request_id, (_, abort_after, arrived) in expected.items():
            if abort_after is not None and step == arrived + abort_after and request_id in harness.scheduler.requests:
                harness.abort(request_id)
                aborted.add(request_id)
        harness.step()
        step += 1
        assert step < 5_000, "no progress: livelock or starvation"
    harness.run_until_idle()  # the overlapped loop may still have a step in flight

    for request_id, (reference, _, _) in expected.items():
        if request_id in aborted:
            assert harness.finish_reasons[request_id] == "abort"
            assert harness.outputs[request_id] == reference[: len(harness.outputs[request_id])]
        else:
            assert harness.outputs[request_id] == reference, f"{request_id} differs from an undisturbed run"
            assert harness.finish_reasons[request_id] in ("stop", "length")
    pool = harness.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert all(t.num_waiting == t.num_running == 0 for t in harness.scheduler.fair_share.tenants.values())


split_table_configs = st.builds(
    SplitTableConfig,
    kv_cache_ratio=st.sampled_from([0.3, 0.5, 0.75, 0.9]),
    dec_blocks=st.integers(0, 3),
    disable_recover=st.booleans(),
)


@MODES
@settings(max_examples=EXAMPLES * 2 // 3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, split_table=split_table_configs, specs=st.lists(request_specs, min_size=1, max_size=12))
def test_split_tables_keep_their_share_and_recovery_yields_the_same_tokens(overlapped, config, split_table, specs):
    harness = Harness(config, split_table, overlapped)
    expected = {}
    for index, spec in enumerate(specs):
        prompt = PREFIXES[spec["shared_prefix"]] + spec["prompt"]
        sampling = wire.SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"])
        try:
            harness.add(f"r{index}", prompt, sampling)
        except ValueError:
            continue
        expected[f"r{index}"] = reference_output(prompt, sampling, config)
    harness.run_until_idle(max_steps=5_000)
    for request_id, reference in expected.items():
        error = harness.errors.get(request_id)
        if error is None:
            assert harness.outputs[request_id] == reference, f"{request_id} differs from an undisturbed run"
        else:
            assert error.startswith("incomplete"), error
            assert harness.outputs[request_id] == reference[: len(harness.outputs[request_id])]
            if not split_table.disable_recover:
                assert "more blocks than the decode table holds" in error
    assert harness.kv.pool.num_free_blocks == config.num_blocks, "blocks leaked"
    assert harness.kv.prefill_used == harness.kv.decode_used == 0


@MODES
@settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    aging_s=st.sampled_from([1.0, 3.0, 10.0]),
    arrivals=st.lists(st.tuples(st.integers(0, 20), st.integers(-2, 2), st.integers(1, 6)), min_size=2, max_size=12),
)
def test_with_room_for_everyone_the_priority_queue_serves_the_smallest_aged_key_first(overlapped, aging_s, arrivals):
    """One seat, blocks for all: each admission takes the waiting request of the smallest arrival +
    priority x aging_s, so a request is passed over by a better priority q < p only if that one
    arrived less than (p - q) x aging_s after it, and never by a worse or equal one that came later."""
    config = SchedulerConfig(
        num_blocks=256, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
        scheduling_policy="priority", priority_aging_s=aging_s,
    )  # fmt: skip
    harness = Harness(config, overlapped=overlapped)
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    key = {}
    while pending or harness.scheduler.requests or harness.loop.in_flight:
        if not (harness.scheduler.requests or harness.loop.in_flight):
            harness.now = max(harness.now, pending[0][1][0])  # idle until the next arrival
        while pending and pending[0][1][0] <= harness.now:
            index, (_, priority, max_tokens) = pending.pop(0)
            harness.add(
                f"r{index}", [index + 1, 2, 3], wire.SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority
            )
            key[f"r{index}"] = harness.now + priority * aging_s
        waiting_before = {r.request_id for r in harness.scheduler.waiting}
        output = harness.step()
        admitted = [r.request_id for r in output.new_requests] if output else []
        for request_id in admitted:
            assert request_id in waiting_before
            assert all(key[request_id] <= key[other] for other in waiting_before - set(admitted)), "served out of order"
        assert harness.steps < 2_000
    for index, (_, _, max_tokens) in enumerate(arrivals):
        assert len(harness.outputs[f"r{index}"]) == max_tokens
