"""A step where every request computes one token takes one_token_step_inputs: the same inputs, and the same
refusals, as the general path builds for it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.contract import wire
from worker.inputs.step_inputs import (
    PENDING_TOKEN,
    RequestState,
    StepError,
    StepInputs,
    any_step_inputs,
    build_step_inputs,
    one_token_step_inputs,
)

NUM_BLOCKS = 24


@st.composite
def one_token_requests(draw, block_size: int):
    """A request computing one token: a decode (of its last token, or of one the step in flight samples) or a
    prompt token short of the last; one in ~7 is refused for a token past its tokens, too few blocks or a block
    outside the cache."""
    num_tokens = draw(st.integers(1, 40))
    awaiting = draw(st.booleans())
    computed = draw(st.integers(max(0, num_tokens - 3), num_tokens - 1 + awaiting))
    fault = draw(st.sampled_from(["none"] * 18 + ["past its tokens", "too few blocks", "block outside"]))
    if fault == "past its tokens":
        computed = num_tokens + awaiting
    needed_blocks = -(-(computed + 1) // block_size)
    num_block_ids = (
        needed_blocks - 1 if fault == "too few blocks" else draw(st.integers(needed_blocks, needed_blocks + 2))
    )
    block_ids = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=num_block_ids, max_size=num_block_ids))
    if fault == "block outside" and block_ids:
        block_ids[draw(st.integers(0, len(block_ids) - 1))] = draw(st.sampled_from([-1, NUM_BLOCKS]))
    return dict(num_tokens=num_tokens, awaiting=awaiting, computed=computed, block_ids=block_ids)


def request_states(specs: list[dict]) -> list[RequestState]:
    return [
        RequestState(
            request_id=f"r{i}",
            token_ids=list(range(100 + i, 100 + i + spec["num_tokens"])),
            num_prompt_tokens=spec["num_tokens"],
            sampling=wire.SamplingParams(),
            block_ids=list(spec["block_ids"]),
            num_computed_tokens=spec["computed"],
            awaiting_token=spec["awaiting"],
        )
        for i, spec in enumerate(specs)
    ]


def built(build, *args) -> StepInputs | str:
    try:
        return build(*args)
    except StepError as exc:
        return f"StepError: {exc}"


def assert_same_inputs(fast: StepInputs, general: StepInputs) -> None:
    for name in (
        "input_ids",
        "positions",
        "slot_mapping",
        "query_start",
        "context_lens",
        "block_table",
        "logits_indices",
    ):
        ours, theirs = getattr(fast, name), getattr(general, name)
        assert ours.dtype == theirs.dtype == np.int64, name
        np.testing.assert_array_equal(ours, theirs, err_msg=name)
    assert [id(s) for s in fast.sampling_requests] == [id(s) for s in general.sampling_requests]
    assert [(i, id(s), p) for i, s, p in fast.pending_tokens] == [(i, id(s), p) for i, s, p in general.pending_tokens]
    assert all(type(i) is int and type(p) is int for i, _, p in fast.pending_tokens)


@settings(max_examples=400, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 4, 16]))
def test_a_step_of_one_token_each_gets_what_the_general_path_builds(data, block_size):
    specs = data.draw(st.lists(one_token_requests(block_size), min_size=1, max_size=9))
    states = request_states(specs)

    fast = built(one_token_step_inputs, states, block_size, NUM_BLOCKS)
    general = built(any_step_inputs, [(state, 1) for state in states], block_size, NUM_BLOCKS)

    if isinstance(general, str) or isinstance(fast, str):
        assert fast == general
    else:
        assert_same_inputs(fast, general)


def test_a_decode_awaiting_its_token_beside_a_prompt_token_gets_its_slots_pending_token_and_sample():
    decoding = request_states([dict(num_tokens=6, awaiting=True, computed=6, block_ids=[3, 5])])[0]
    prompt_tail = request_states([dict(num_tokens=9, awaiting=False, computed=4, block_ids=[7, 2, 9])])[0]
    inputs = build_step_inputs([(decoding, 1), (prompt_tail, 1)], 4, NUM_BLOCKS)
    assert inputs.input_ids.tolist() == [PENDING_TOKEN, prompt_tail.token_ids[4]]
    assert inputs.slot_mapping.tolist() == [5 * 4 + 2, 2 * 4 + 0]
    assert inputs.sampling_requests == [decoding]  # the prompt has 4 tokens to go: nothing to sample yet
    assert inputs.block_table.tolist() == [[3, 5, 0], [7, 2, 9]]
    with pytest.raises(StepError, match="r0 has a block id outside the cache"):
        build_step_inputs([(decoding, 1)], 4, num_blocks=5)
