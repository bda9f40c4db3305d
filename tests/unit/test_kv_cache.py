"""The block pool and the KV-cache manager, one rule a test: which free block is handed out first,
what the prefix cache registers and evicts (the events the api's router follows), what preempting
a request would cost, and what an ended request leaves behind."""

from __future__ import annotations

import pytest

from service.contract import wire
from service.scheduler.block_pool import BlockPool
from service.scheduler.kv_cache_manager import KVCacheManager
from service.scheduler.request import Request
from service.scheduler.scheduler import SchedulerConfig
from tests.support.scheduler_harness import Harness

# ---------------------------------------------------------------------- the block pool


def test_freeing_a_block_more_often_than_it_was_allocated_raises():
    pool = BlockPool(num_blocks=2, block_size=4)
    [block_id] = pool.allocate(1)
    pool.free([block_id])
    with pytest.raises(RuntimeError, match=f"block {block_id} freed more often than allocated"):
        pool.free([block_id])


def test_a_freed_block_without_a_cached_prefix_is_handed_out_before_any_cached_one():
    """A freed plain block goes to the head of the free list, a cached one to the tail: allocation
    reuses the plain block and the cached prefix stays findable."""
    pool = BlockPool(num_blocks=2, block_size=2)
    cached, plain = pool.allocate(2)
    pool.cache_blocks([(cached, 111, [1, 2])])
    pool.free([cached])
    pool.free([plain])
    assert pool.allocate(1) == [plain]
    assert pool.find_cached_prefix([111], [1, 2], max_blocks=1) == [cached]


def test_handing_out_a_cached_free_block_evicts_its_hash_and_reports_the_eviction():
    pool = BlockPool(num_blocks=1, block_size=2)
    [block_id] = pool.allocate(1)
    pool.cache_blocks([(block_id, 111, [1, 2])])
    pool.free([block_id])
    assert pool.take_cache_events() == ([111], [True])
    assert pool.num_cached_free == 1
    assert pool.allocate(1) == [block_id]
    assert pool.take_cache_events() == ([111], [False])
    assert pool.cached_hashes() == [] and pool.num_cached_free == 0
    assert pool.find_cached_prefix([111], [1, 2], max_blocks=1) == []
    pool.cache_blocks([(block_id, 111, [1, 2])])  # the same content may be cached again
    assert pool.take_cache_events() == ([111], [True])


def test_cache_blocks_registers_only_the_full_blocks_given_and_keeps_their_token_ids():
    pool = BlockPool(num_blocks=3, block_size=2)
    block_ids = pool.allocate(3)
    pool.cache_blocks([(block_ids[1], 11, [3, 4]), (block_ids[2], 12, [5, 6])])
    assert pool.take_cache_events() == ([11, 12], [True, True])
    assert pool.blocks[block_ids[0]].block_hash is None
    assert pool.blocks[block_ids[2]].token_ids == (5, 6)


# ---------------------------------------------------------------------- the KV-cache manager


def _computed(kv: KVCacheManager, request_id: str, token_ids: list[int]) -> Request:
    """A request admitted with its cached prefix and its whole prompt computed and cached."""
    request = Request(request_id, token_ids, wire.SamplingParams(max_tokens=1), 0.0, max_num_tokens=len(token_ids) + 1)
    cached_blocks = kv.get_computed_blocks(request)
    kv.allocate_slots(request, len(token_ids), cached_blocks)
    request.num_computed_tokens = len(token_ids)
    kv.cache_blocks([(request, len(token_ids))])
    return request


def test_recompute_cost_counts_the_computed_tokens_past_the_leading_blocks_another_request_holds():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prefix = list(range(1, 9))  # two full blocks
    first = _computed(kv, "first", prefix + [1])
    shares = _computed(kv, "shares", prefix + [2] * 5)
    alone = _computed(kv, "alone", [3] * 6)
    assert [kv.recompute_cost(r) for r in (first, shares, alone)] == [9 - 8, 13 - 8, 6]
    shares.num_computed_tokens = 8  # what it computed sits in blocks "first" holds too: nothing lost
    assert kv.recompute_cost(shares) == 0


def test_a_prefix_hit_caches_the_request_s_own_following_blocks_under_their_own_tokens():
    """ "second" finds "first"'s two blocks and computes a third; a third request with those twelve
    tokens finds all three blocks."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prefix = list(range(1, 9))
    _computed(kv, "first", prefix + [1])
    kv.take_cache_events()
    second = _computed(kv, "second", prefix + [2, 3, 4, 5, 6])
    assert len(kv.take_cache_events()[0]) == 1  # its own full block only
    third = Request("third", prefix + [2, 3, 4, 5, 7], wire.SamplingParams(max_tokens=1), 0.0, max_num_tokens=14)
    assert kv.get_computed_blocks(third) == kv.block_ids(second)[:3]


def test_an_ended_request_leaves_no_state_in_the_kv_cache_manager():
    """Blocks, slots, owed blocks and block hashes go with the request (a preempted one keeps its
    hashes to resume with): nothing grows with the number of requests served."""
    harness = Harness(SchedulerConfig(num_blocks=12, block_size=4, max_num_batched_tokens=64, max_model_len=128))
    for i in range(4):
        harness.add(f"r{i}", [10 + i] * 6, wire.SamplingParams(max_tokens=30, ignore_eos=True))
    harness.run_until_idle()
    assert harness.scheduler.counters.num_preemptions > 0
    kv = harness.kv
    assert kv._held == {} and kv.num_slots == {} and kv._block_hashes == {}
    assert (kv.owed_prompt_blocks, kv.owed_output_blocks) == (0, 0)
