"""The scheduler's rules, one deterministic trace each: the admission reserve, skip-ahead and
aging, the victim choice, the prefix cache's verification, and aborts that free every block.

Each test pins one rule so that changing it (a mutant) fails a test with its name.
"""

from __future__ import annotations

import math

import pytest

from service.contract import wire
from service.scheduler import kv_cache_manager
from service.scheduler.admission import ReserveAdmission
from service.scheduler.block_pool import BlockPool
from service.scheduler.kv_cache_manager import MAX_OUTPUT_TOKENS_CONSIDERED, KVCacheManager
from service.scheduler.request import Request, RequestStatus
from service.scheduler.scheduler import SchedulerConfig
from tests.support.scheduler_harness import Harness, greedy, reference_output

MODES = pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])


def config(**overrides) -> SchedulerConfig:
    values = dict(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    values.update(overrides)
    return SchedulerConfig(**values)


def scheduled_ids(output: wire.SchedulerOutput) -> list[str]:
    return [r.request_id for r in output.new_requests] + [r.request_id for r in output.running_requests]


def status(harness: Harness, request_id: str) -> RequestStatus | None:
    request = harness.scheduler.requests.get(request_id)
    return None if request is None else request.status


# ---------------------------------------------------------------------- the admission reserve


@MODES
def test_the_reserve_for_running_output_holds_back_a_prompt_that_fits_the_free_blocks(overlapped):
    """16 blocks of 4: "long" holds 1 block and owes 10 for its output (7 reserved at ratio 0.7).
    "big" needs 9 blocks: they are free, but not beside the reserve, so it waits, and nobody is
    ever preempted. Without the reserve it is admitted at once and a preemption follows."""
    harness = Harness(config(enable_prefix_caching=False), overlapped=overlapped)
    harness.add("long", [1] * 4, greedy(40))
    harness.step()
    harness.add("big", [2] * 36, greedy(8))
    harness.step()
    assert status(harness, "big") is RequestStatus.WAITING
    assert harness.kv.pool.num_free_blocks >= 9  # it would fit, but for the reserve
    while status(harness, "long") is not None:
        assert status(harness, "big") is RequestStatus.WAITING
        harness.step()
    harness.run_until_idle()
    assert harness.scheduler.counters.num_preemptions == 0
    assert harness.outputs["big"] == reference_output([2] * 36, greedy(8), harness.config)


def test_the_reserve_counts_a_running_chunked_prompt_in_full():
    """ "chunked" is admitted with its whole 40-token prompt fitting, computed 8 tokens a step; while
    its prompt is unfinished, its 8 missing prompt blocks are reserved and "small" (3 blocks,
    which would fit the free blocks) waits; "chunked" finishes its prompt without a preemption."""
    harness = Harness(config(max_num_batched_tokens=8, enable_prefix_caching=False))
    harness.add("chunked", [1] * 40, greedy(1))  # 10 blocks; 2 held after the first chunk
    harness.step()
    harness.add("small", [2] * 10, greedy(2))  # 3 blocks: 14 are free
    assert harness.kv.owed_blocks(harness.scheduler.requests["chunked"]) == (8, 0)
    harness.step()
    assert status(harness, "small") is RequestStatus.WAITING
    harness.run_until_idle()
    assert harness.scheduler.counters.num_preemptions == 0


def _request(prompt_len: int, max_tokens: int, max_model_len: int = 10_000) -> Request:
    max_num_tokens = min(prompt_len + max_tokens, max_model_len)
    return Request("r", [1] * prompt_len, greedy(max_tokens), 0.0, max_num_tokens=max_num_tokens)


def _holding(kv: KVCacheManager, request: Request, num_blocks: int) -> Request:
    """`request`, given `num_blocks` blocks of `kv`."""
    if num_blocks:
        kv.allocate_slots(request, num_blocks * kv.block_size)
    assert len(kv.block_ids(request)) == num_blocks
    return request


@pytest.mark.parametrize(
    ("prompt_len", "output_len", "held", "max_tokens", "expected"),
    [
        # 10 prompt tokens: 3 blocks; at most 30 tokens in all, the last never computed: 8 blocks.
        (10, 0, 0, 20, (3, 5)),
        (10, 0, 1, 20, (2, 5)),
        (10, 0, 3, 20, (0, 5)),
        (10, 0, 5, 20, (0, 3)),  # blocks held past the prompt are output blocks already had
        (10, 6, 4, 20, (0, 4)),  # 16 tokens: 4 blocks, all held; 30 tokens need 8
        (10, 19, 8, 20, (0, 0)),  # one token left: it is never computed
        (3, 0, 1, 1, (0, 0)),  # one output token: nothing beyond the prompt
    ],
)
def test_owed_blocks_are_the_unfinished_prompt_and_the_future_output(
    prompt_len, output_len, held, max_tokens, expected
):
    kv = KVCacheManager(num_blocks=16, block_size=4)
    request = _request(prompt_len, max_tokens)
    request.token_ids.extend([7] * output_len)
    assert kv.owed_blocks(_holding(kv, request, held)) == expected


def test_owed_output_is_capped_at_the_tokens_considered():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    request = _holding(kv, _request(8, 100_000, max_model_len=1_000_000), 2)
    cap = MAX_OUTPUT_TOKENS_CONSIDERED
    assert kv.owed_blocks(request) == (0, math.ceil((8 + cap - 1) / 4) - 2)


def test_reserved_blocks_are_the_prompts_in_full_and_the_output_scaled_by_the_ratio_rounded_up():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admission = ReserveAdmission(kv, init_ratio=0.5, min_ratio=0.1, decay_steps=4)
    first = _holding(kv, _request(10, 20), 1)  # owes (2, 5)
    _holding(kv, _request(6, 4), 2)  # 6 tokens, 2 blocks held: owes (0, 1)
    assert (kv.owed_prompt_blocks, kv.owed_output_blocks) == (2, 6)
    assert admission.reserved_blocks() == 2 + 3
    admission.on_step()  # 0.5 - 0.1
    assert admission.reserved_blocks() == 2 + math.ceil(0.4 * 6)
    for _ in range(10):
        admission.on_step()
    assert admission.ratio == pytest.approx(0.1)  # decays to the floor, no further
    admission.on_preemption()
    assert admission.ratio == 0.5
    kv.free(first)
    assert admission.reserved_blocks() == 1


def _fill_until_preemption(harness: Harness) -> wire.SchedulerOutput:
    """Step until a step preempts; return that step's message."""
    for _ in range(200):
        output = harness.step()
        if output is not None and output.preempted_request_ids:
            return output
    raise AssertionError("no preemption happened")


def _preempting_harness(overlapped: bool = False) -> Harness:
    """Two requests whose outputs outgrow 12 blocks of 4 tokens: one is preempted around step 15."""
    harness = Harness(config(num_blocks=12, enable_prefix_caching=False), overlapped=overlapped)
    harness.add("a", [1] * 4, greedy(40))
    harness.add("b", [2] * 4, greedy(40))
    return harness


def test_a_preempting_step_resets_the_reserve_ratio():
    harness = _preempting_harness()
    reserve = harness.scheduler.admission
    harness.step()
    assert reserve.ratio < reserve.init_ratio  # decays while steps run
    _fill_until_preemption(harness)
    assert reserve.ratio >= reserve.init_ratio - reserve.decay  # back up (this step's decay at most)


@MODES
def test_a_step_that_preempts_admits_nobody(overlapped):
    """ "tiny" would fit beside the reserve once a request was preempted; vLLM skips the waiting
    queue in a step that preempted, and so does this scheduler: "tiny" is admitted a step later."""
    harness = _preempting_harness(overlapped)
    harness.step()
    harness.add("tiny", [3], greedy(1))  # held back by the reserve for the two outputs until then
    output = _fill_until_preemption(harness)
    assert "tiny" not in scheduled_ids(output)
    assert status(harness, "tiny") is RequestStatus.WAITING
    harness.run_until_idle()
    assert harness.outputs["tiny"] == reference_output([3], greedy(1), harness.config)


# ---------------------------------------------------------------------- skip-ahead and aging


def _holder_harness(**overrides) -> Harness:
    """ "holder" keeps 10 of 16 blocks for 20 steps and 4 in reserve: a 12-token prompt (3 blocks)
    cannot be admitted beside it, a 1-token prompt can."""
    harness = Harness(config(enable_prefix_caching=False, **overrides))
    harness.add("holder", [1] * 40, greedy(20))
    harness.step()
    return harness


@pytest.mark.parametrize(("num_too_big", "small_admitted"), [(2, True), (3, False)])
def test_skip_ahead_looks_past_at_most_max_skip_ahead_requests_that_do_not_fit(num_too_big, small_admitted):
    """With max_skip_ahead=2 a round looks at the head and 2 more that do not fit; a fitting
    request behind 2 of them is admitted, one behind 3 is not."""
    harness = _holder_harness(max_skip_ahead=2)
    for i in range(num_too_big):
        harness.add(f"too-big-{i}", [2 + i] * 12, greedy(1))
    harness.add("small", [9], greedy(1))
    output = harness.step()
    assert ("small" in scheduled_ids(output)) is small_admitted
    assert not any(request_id.startswith("too-big") for request_id in scheduled_ids(output))


def test_a_head_is_passed_over_in_max_head_skips_rounds_then_blocks_everyone_behind_it():
    harness = _holder_harness(max_head_skips=3)
    harness.add("head", [2] * 12, greedy(1))
    admitted_past_the_head = []
    for round_number in range(1, 6):
        harness.add(f"small-{round_number}", [9 + round_number], greedy(1))
        output = harness.step()
        assert "head" not in scheduled_ids(output)
        admitted_past_the_head.append(f"small-{round_number}" in scheduled_ids(output))
    assert admitted_past_the_head == [True, True, True, False, False]
    harness.run_until_idle()
    assert harness.outputs["head"] == reference_output([2] * 12, greedy(1), harness.config)


# ---------------------------------------------------------------------- the victim


def _grow_until_preemption(harness: Harness, prompts: dict[str, list[int]], max_tokens: int) -> list[str]:
    for request_id, prompt in prompts.items():
        harness.add(request_id, prompt, greedy(max_tokens))
    output = _fill_until_preemption(harness)
    return output.preempted_request_ids


@MODES
def test_min_recompute_breaks_a_tie_by_preempting_the_newest(overlapped):
    """Three 4-token prompts admitted together grow in step: when "c" finds no block, "b" and
    "c" (the oldest is never offered) would recompute as much, and the newest, "c", goes."""
    harness = Harness(config(num_blocks=5, enable_prefix_caching=False), overlapped=overlapped)
    preempted = _grow_until_preemption(harness, {"a": [1] * 4, "b": [2] * 4, "c": [3] * 4}, max_tokens=2)
    assert preempted == ["c"]
    harness.run_until_idle()
    for request_id, token in (("a", 1), ("b", 2), ("c", 3)):
        assert harness.outputs[request_id] == reference_output([token] * 4, greedy(2), harness.config)


def test_min_recompute_does_not_count_blocks_another_running_request_also_holds():
    """ "shares" has computed more tokens than "alone", but 8 of them sit in blocks "first" holds
    too, which stay cached: recomputing "shares" costs less, so it is the victim."""
    harness = Harness(config(num_blocks=12))
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks
    harness.add("first", prefix + [1], greedy(10))
    harness.step()
    harness.add("shares", prefix + [2] * 4, greedy(10))
    harness.add("alone", [3] * 9, greedy(10))
    for _ in range(200):
        computed = {r.request_id: r.num_computed_tokens for r in harness.scheduler.running}
        output = harness.step()
        if output.preempted_request_ids:
            break
    assert output.preempted_request_ids == ["shares"]
    assert computed["shares"] > computed["alone"]  # more work done, less of it lost
    harness.run_until_idle()
    assert harness.outputs["shares"] == reference_output(prefix + [2] * 4, greedy(10), harness.config)


@MODES
def test_the_longest_running_request_is_never_preempted(overlapped):
    """ "oldest" would be the cheapest victim (a short prompt; its prefix shared with "second"),
    but the longest-running request is never offered, so it always progresses."""
    harness = Harness(config(num_blocks=10), overlapped=overlapped)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    harness.add("oldest", prefix + [1], greedy(20))
    harness.step()
    harness.add("second", prefix + [2] * 8, greedy(20))
    while harness.scheduler.requests or harness.loop.in_flight:
        harness.step()
        if "oldest" in harness.scheduler.requests:
            assert harness.scheduler.requests["oldest"].num_preemptions == 0
    assert harness.preempted and "oldest" not in harness.preempted
    assert harness.outputs["oldest"] == reference_output(prefix + [1], greedy(20), harness.config)


# ---------------------------------------------------------------------- the prefix cache


def test_a_cached_block_whose_hash_matches_but_whose_tokens_differ_is_a_miss():
    pool = BlockPool(num_blocks=4, block_size=2)
    [block_id] = pool.allocate(1)
    pool.cache_blocks([(block_id, 1234, [7, 8])])
    pool.free([block_id])
    assert pool.find_cached_prefix([1234], [7, 8, 9], max_blocks=1) == [block_id]
    assert pool.find_cached_prefix([1234], [7, 9, 9], max_blocks=1) == []  # same hash, other tokens


@MODES
def test_requests_whose_block_hashes_all_collide_still_get_their_own_output(monkeypatch, overlapped):
    """Every block hash made equal: only blocks whose stored tokens match may be shared."""

    def colliding_hashes(block_hashes, token_ids, block_size):
        for _ in range(len(block_hashes) * block_size, len(token_ids) - block_size + 1, block_size):
            block_hashes.append(42)

    monkeypatch.setattr(kv_cache_manager, "extend_block_hashes", colliding_hashes)
    harness = Harness(config(), overlapped=overlapped)
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 6, 6, 6, 6, 6], "c": [9, 9, 9, 9, 1]}
    for request_id, prompt in prompts.items():
        harness.add(request_id, prompt, greedy(6))
        harness.step()
    harness.run_until_idle()
    for request_id, prompt in prompts.items():
        assert harness.outputs[request_id] == reference_output(prompt, greedy(6), harness.config)
    assert harness.scheduler.counters.prefix_cache_hits == 4  # "b" shares a's first block, nothing else


# ---------------------------------------------------------------------- aborts


@MODES
@pytest.mark.parametrize("shares_a_prefix", [False, True], ids=["own-blocks", "shared-prefix"])
def test_an_abort_in_the_middle_of_a_prefill_frees_every_block(overlapped, shares_a_prefix):
    harness = Harness(config(max_num_batched_tokens=8), overlapped=overlapped)
    prefix = list(range(1, 9))
    if shares_a_prefix:
        harness.add("cached", prefix + [50], greedy(1))
        harness.run_until_idle()
    harness.add("long", prefix + list(range(20, 52)), greedy(4))  # 40 tokens, 8 a step
    harness.step()
    harness.step()
    long = harness.scheduler.requests["long"]
    assert 0 < long.num_computed_tokens < long.num_tokens and harness.kv.block_ids(long)  # in its prompt
    harness.abort("long")
    harness.run_until_idle()
    pool = harness.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert harness.finish_reasons["long"] == "abort"
