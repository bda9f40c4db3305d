"""The split-table baseline's rules, one a test: the prefill share's admission quota, growth and
recovery from the decode share, who is suspended, when a request ends as too long instead, and
the usage each share reports."""

from __future__ import annotations

import pytest

from service.scheduler.request import Request, RequestStatus
from service.scheduler.scheduler import RequestRejected, SchedulerConfig
from service.scheduler.split_table import (
    TOO_LONG,
    SplitTableConfig,
    SplitTableKVCacheManager,
    SuspendPreemption,
)
from tests.support.scheduler_harness import Harness, greedy, reference_output

BLOCK_SIZE = 4


def split_kv(num_blocks: int = 8, dec_blocks: int = 0) -> SplitTableKVCacheManager:
    """Half the blocks for prompts, half for decodes (4 + 4 with the default)."""
    return SplitTableKVCacheManager(num_blocks, BLOCK_SIZE, SplitTableConfig(kv_cache_ratio=0.5, dec_blocks=dec_blocks))


def admitted(kv: SplitTableKVCacheManager, request_id: str, num_tokens: int) -> Request:
    """A request with a one-block prompt, admitted, then grown to `num_tokens` tokens."""
    request = Request(request_id, [1] * BLOCK_SIZE, greedy(100), 0.0, max_num_tokens=BLOCK_SIZE + 100)
    assert kv.allocate_slots(request, BLOCK_SIZE) is not None
    request.token_ids += [7] * (num_tokens - BLOCK_SIZE)
    if num_tokens > BLOCK_SIZE:
        assert kv.allocate_slots(request, num_tokens) is not None
    return request


def test_a_prompt_may_take_the_whole_prefill_share_and_no_more():
    """16 blocks of 4 at ratio 0.5: 8 prefill blocks. A 28-token prompt and its one decode block
    take exactly 8 and are served; a 29-token prompt needs 9 and is rejected."""
    harness = Harness(
        SchedulerConfig(num_blocks=16, block_size=BLOCK_SIZE, max_num_batched_tokens=64, max_model_len=64),
        SplitTableConfig(kv_cache_ratio=0.5, dec_blocks=1),
    )
    with pytest.raises(RequestRejected, match="the prompt needs 9 prefill blocks but the prefill table holds 8"):
        harness.add("too-long", [1] * 29, greedy(2))
    harness.add("whole-share", [1] * 28, greedy(2))
    harness.run_until_idle()
    assert harness.outputs["whole-share"] == reference_output([1] * 28, greedy(2), harness.config)


def test_growth_takes_the_missing_blocks_from_the_decode_share_up_to_all_of_it():
    kv = split_kv()
    request = admitted(kv, "r", BLOCK_SIZE)
    assert (kv.prefill_used, kv.decode_used, kv.decode_blocks(request)) == (1, 0, 0)
    assert len(kv.allocate_slots(request, 2 * BLOCK_SIZE)) == 1
    assert (kv.prefill_used, kv.decode_used, kv.decode_blocks(request)) == (1, 1, 1)
    assert kv.allocate_slots(request, 2 * BLOCK_SIZE) == []  # it holds them already
    assert len(kv.allocate_slots(request, 5 * BLOCK_SIZE)) == 3  # the decode share's last block
    assert kv.decode_used == kv.decode_capacity == 4
    assert kv.allocate_slots(request, 5 * BLOCK_SIZE + 1) is None
    assert kv.pool_usage() == [("prefill", 4, 1), ("decode", 4, 4)]


def test_a_request_that_holds_no_blocks_holds_no_decode_blocks():
    kv = split_kv()
    waiting = Request("waiting", [1, 2], greedy(4), 0.0, max_num_tokens=6)
    assert kv.decode_blocks(waiting) == 0


def test_a_suspended_request_keeps_its_prompt_blocks_and_has_nothing_to_compute_into():
    kv = split_kv()
    request = admitted(kv, "r", 3 * BLOCK_SIZE)
    prompt_block = kv.block_ids(request)[0]
    kv.suspend(request)
    assert kv.is_suspended(request) and kv.block_ids(request) == [prompt_block]
    assert (kv.prefill_used, kv.decode_used, kv.decode_blocks(request)) == (1, 0, 0)
    assert kv.num_slots[request] == 0


@pytest.mark.parametrize(("num_tokens", "recovers"), [(5 * BLOCK_SIZE, True), (5 * BLOCK_SIZE + 1, False)])
def test_a_suspended_request_recovers_while_its_whole_sequence_fits_the_decode_share(num_tokens, recovers):
    """20 tokens: 5 blocks, the kept prompt block and 4 decode blocks, the whole decode share: it
    waits while another request holds decode blocks, then takes all 4. 21 tokens never fit: it
    is suspended again, as too long."""
    kv = split_kv()
    request = admitted(kv, "r", 2 * BLOCK_SIZE)
    other = admitted(kv, "other", 2 * BLOCK_SIZE)
    kv.suspend(request)
    request.token_ids += [7] * (num_tokens - len(request.token_ids))
    preemption = SuspendPreemption(kv, disable_recover=False)
    assert kv.can_ever_recover(request) is recovers
    assert kv.allocate_slots(request, num_tokens) is None  # "other" holds a decode block
    assert preemption.choose_victim(request, [other, request]) is (None if recovers else request)
    kv.free(other)
    block_ids = kv.allocate_slots(request, num_tokens)
    if recovers:
        assert len(block_ids) == 5 and kv.block_ids(request) == block_ids and not kv.is_suspended(request)
        assert (kv.decode_used, kv.decode_blocks(request)) == (4, 4)
    else:
        assert block_ids is None and preemption.preempt(request) == TOO_LONG


def test_the_request_holding_the_most_decode_blocks_is_suspended_even_if_it_holds_just_one():
    kv = split_kv(num_blocks=12)  # 6 + 6
    one = admitted(kv, "one", 2 * BLOCK_SIZE)  # 1 decode block
    three = admitted(kv, "three", 4 * BLOCK_SIZE)  # 3 decode blocks
    none = admitted(kv, "none", BLOCK_SIZE)
    preemption = SuspendPreemption(kv, disable_recover=False)
    assert preemption.choose_victim(one, [one, three, none]) is three
    assert preemption.choose_victim(none, [none, one]) is one
    assert preemption.preempt(one) is None and kv.is_suspended(one)


def test_with_no_decode_blocks_held_the_requester_itself_ends_as_too_long():
    """Nobody has decode blocks to give back: the requester is chosen, and it ends (nobody else)."""
    kv = split_kv()
    first, second = admitted(kv, "first", BLOCK_SIZE), admitted(kv, "second", BLOCK_SIZE)
    preemption = SuspendPreemption(kv, disable_recover=False)
    assert preemption.choose_victim(second, [first, second]) is second
    assert preemption.preempt(second) == TOO_LONG and not kv.is_suspended(second)


def test_aborting_a_waiting_request_leaves_both_shares_as_they_were():
    harness = Harness(
        SchedulerConfig(num_blocks=16, block_size=BLOCK_SIZE, max_num_batched_tokens=64, max_model_len=64),
        SplitTableConfig(kv_cache_ratio=0.5, dec_blocks=1),
    )
    harness.add("running", [1] * 10, greedy(8))  # 4 prefill blocks
    harness.add("first", [2] * 10, greedy(8))  # 4 more: the prefill share is full
    harness.add("waiting", [3] * 10, greedy(8))
    harness.step()
    assert harness.scheduler.requests["waiting"].status is RequestStatus.WAITING
    harness.abort("waiting")  # the harness checks both shares' counts against the running requests
    assert harness.kv.prefill_used == 8
    harness.run_until_idle()
    assert harness.kv.prefill_used == harness.kv.decode_used == 0
