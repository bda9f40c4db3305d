"""Edges of the learned step cost, the block pool, the KV-cache manager and the admission reserve,
one rule a test: when the cost model is fitted and trusted, how it sizes a prompt chunk, which
pool sizes are refused, and which waiting requests one admission round takes."""

from __future__ import annotations

import math
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.contract import wire
from service.scheduler.admission import ReserveAdmission
from service.scheduler.block_pool import BlockPool
from service.scheduler.kv_cache_manager import MAX_OUTPUT_TOKENS_CONSIDERED, KVCacheManager
from service.scheduler.request import Request
from service.scheduler.step_cost import MIN_OBSERVATIONS, REFIT_EVERY, StepCostModel

# ---------------------------------------------------------------------- the learned step cost

FIXED, PER_REQUEST, PER_TOKEN, PER_KILOTOKEN = 0.010, 0.001, 0.002, 0.0005
STEPS = [(1, 200, 20_000), (4, 4, 4_000), (8, 60, 30_000), (2, 2, 500), (3, 90, 1_000), (6, 6, 12_000)]


def device_seconds(num_requests: int, num_tokens: int, attended_tokens: int) -> float:
    """10 ms a step, 1 ms a request, 2 ms a token and 0.5 ms per thousand attended cached tokens."""
    return FIXED + PER_REQUEST * num_requests + PER_TOKEN * num_tokens + PER_KILOTOKEN * attended_tokens / 1000


def trained_model() -> StepCostModel:
    model = StepCostModel()
    for step in STEPS * 3:
        model.observe(*step, device_seconds(*step))
    return model


def test_a_model_that_has_seen_no_step_costs_nothing_and_limits_no_prompt_chunk():
    model = StepCostModel()
    assert model.coefficients() == {"fixed": 0.0, "per_request": 0.0, "per_token": 0.0, "per_context_kilotoken": 0.0}
    assert model.prefill_tokens_within(0.1, num_decodes=4, decode_attended=400, prefill_context=0) > 1_000_000


def test_the_model_is_trusted_from_the_eighth_observed_step_on():
    model = StepCostModel()
    for count in range(1, MIN_OBSERVATIONS + 1):
        model.observe(2, 10, 1_000, 0.05)
        assert model.num_observations == count
        assert model.ready == (count >= MIN_OBSERVATIONS)


def test_the_first_observed_step_is_fitted_at_once():
    model = StepCostModel()
    model.observe(2, 10, 1_000, 0.05)
    c = model.coefficients()
    predicted = c["fixed"] + 2 * c["per_request"] + 10 * c["per_token"] + 1.0 * c["per_context_kilotoken"]
    assert predicted == pytest.approx(0.05, rel=1e-6)


def test_the_coefficients_are_refitted_once_every_refit_every_observations():
    model = StepCostModel()
    for _ in range(MIN_OBSERVATIONS):
        model.observe(2, 10, 1_000, 0.05)
    first = model.coefficients()
    for _ in range(REFIT_EVERY - 1):
        model.observe(8, 100, 9_000, 0.5)
    assert model.coefficients() == first  # seven new steps: the fit stands
    model.observe(8, 100, 9_000, 0.5)
    assert model.coefficients() != first  # the eighth: refitted


def test_an_untrusted_model_charges_every_second_it_saw_to_the_tokens():
    """Before the eighth step a chunk the size of those timed is never underpriced: a 100-token step of
    10 ms fixed + 2 ms a token is charged 2.1 ms a token, so 0.21 s buys 100 tokens, not the 100 + 5 that
    the device would really compute."""
    model = StepCostModel()
    model.observe(1, 100, 5_000, FIXED + PER_TOKEN * 100)
    assert not model.ready
    assert model.coefficients() == {"fixed": 0.0, "per_request": 0.0, "per_token": pytest.approx(0.0021),
                                    "per_context_kilotoken": 0.0}  # fmt: skip
    assert model.prefill_tokens_within(0.21 + 1e-9, num_decodes=0, decode_attended=0, prefill_context=0) == 100


def test_as_many_requests_as_tokens_in_every_step_is_fitted_without_error():
    """`n: 64` of a one-token prompt: the requests and tokens columns are equal in every step, and the
    entries grow past 10^4 (a fixed ridge of 1e-12 was lost to rounding and the solve raised)."""
    model = StepCostModel()
    for step in range(40):
        model.observe(64, 64, 64 * (step + 1), 0.02 + 0.001 * 64)
        coefficients = model.coefficients()
    predicted = coefficients["fixed"] + 64 * (coefficients["per_request"] + coefficients["per_token"])
    assert predicted == pytest.approx(0.084, rel=1e-3)


step_mixes = st.lists(
    st.tuples(
        st.integers(1, 1024),  # requests
        st.sampled_from([None, 0]) | st.integers(1, 16_384),  # tokens: as many as requests (None), or any
        st.integers(0, 10**8),  # cached tokens read
        st.floats(0, 60),  # seconds
    ),
    min_size=1,
    max_size=3 * REFIT_EVERY,
)


@settings(max_examples=300, deadline=None)
@given(step_mixes)
def test_any_mix_of_steps_fits_to_finite_non_negative_coefficients(steps):
    model = StepCostModel()
    for num_requests, num_tokens, attended, seconds in steps:
        model.observe(num_requests, num_requests if num_tokens is None else num_tokens, attended, seconds)
        coefficients = model.coefficients()
        assert all(math.isfinite(value) and value >= 0 for value in coefficients.values()), coefficients
        assert model.prefill_tokens_within(0.5, num_decodes=8, decode_attended=4_000, prefill_context=100) >= 0


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -0.1])
def test_a_step_time_that_is_not_a_duration_is_refused(seconds):
    model = StepCostModel()
    with pytest.raises(ValueError, match="a step cannot take"):
        model.observe(1, 1, 0, seconds)
    assert model.num_observations == 0


def test_the_cost_of_attended_context_is_learned_per_thousand_tokens():
    coefficients = trained_model().coefficients()
    assert coefficients["fixed"] == pytest.approx(FIXED, rel=1e-6)
    assert coefficients["per_request"] == pytest.approx(PER_REQUEST, rel=1e-6)
    assert coefficients["per_token"] == pytest.approx(PER_TOKEN, rel=1e-6)
    assert coefficients["per_context_kilotoken"] == pytest.approx(PER_KILOTOKEN, rel=1e-6)


def test_a_prompt_chunk_pays_for_the_context_it_and_the_decodes_read():
    """Beside 4 decodes reading 8000 cached tokens a step costs 10 + 5 x 1 + 4 x 2 + 8 x 0.5 = 27 ms; a
    prompt token reading 2000 cached tokens costs 2 + 2 x 0.5 = 3 ms. A budget of 27 ms + 24.9995 x 3 ms
    holds 24 such tokens, not 25."""
    model = trained_model()
    budget_s = 0.027 + 0.003 * 24.9995
    assert model.prefill_tokens_within(budget_s, num_decodes=4, decode_attended=8_000, prefill_context=2_000) == 24


def test_no_prompt_token_fits_a_budget_the_decodes_already_spend():
    model = trained_model()
    assert model.prefill_tokens_within(0.02, num_decodes=4, decode_attended=8_000, prefill_context=0) == 0


# ---------------------------------------------------------------------- the block pool


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (-1, 4), (4, 0), (4, -1)])
def test_a_pool_without_blocks_or_with_empty_blocks_is_refused(num_blocks, block_size):
    with pytest.raises(ValueError, match="^num_blocks and block_size must be positive$"):
        BlockPool(num_blocks, block_size)


def test_a_pool_of_one_block_of_one_token_is_allowed():
    pool = BlockPool(num_blocks=1, block_size=1)
    assert pool.allocate(1) == [0]


# ---------------------------------------------------------------------- the KV-cache manager


def request(request_id: str, num_prompt_tokens: int, max_num_tokens: int, priority: int = 0) -> Request:
    prompt = [(hash(request_id) + i) % 1000 + 1 for i in range(num_prompt_tokens)]
    sampling = wire.SamplingParams(max_tokens=max_num_tokens - num_prompt_tokens)
    return Request(request_id, prompt, sampling, 0.0, max_num_tokens=max_num_tokens, priority=priority)


def test_num_slots_counts_the_tokens_a_request_s_blocks_hold():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    short = request("short", 5, 6)
    kv.allocate_slots(short, 5)
    assert kv.num_slots[short] == 8


def test_caching_the_blocks_of_a_request_that_holds_none_does_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    freed = request("freed", 8, 9)
    kv.allocate_slots(freed, 8)
    kv.free(freed)
    kv.cache_blocks([(freed, 8)])  # a step in flight returned after its blocks were freed
    assert kv.take_cache_events() == ([], [])


def test_the_owed_output_follows_the_token_that_brings_the_remaining_output_down_to_the_cap():
    """A remaining output longer than MAX_OUTPUT_TOKENS_CONSIDERED is counted as that long; the token that
    brings it down to exactly the cap moves the counted end to the request's real end (one more block here)."""
    kv = KVCacheManager(num_blocks=2048, block_size=4)
    long = request("long", 900, 900 + MAX_OUTPUT_TOKENS_CONSIDERED + 6)
    kv.allocate_slots(long, 912)
    while len(long.token_ids) < 910:
        long.token_ids.append(7)
        kv.on_token(long)
        assert (kv.owed_prompt_blocks, kv.owed_output_blocks) == kv.owed_blocks(long), len(long.token_ids)


# ---------------------------------------------------------------------- the admission reserve


def test_a_token_budget_of_one_still_admits_a_request_with_one_token_and_its_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admission = ReserveAdmission(kv)
    waiting = deque([request("one", 8, 9)])
    [admitted] = admission.admit(waiting, budget=1, num_seats=4)
    assert admitted.num_new_tokens == 1
    assert admitted.block_ids == kv.block_ids(admitted.request) and len(admitted.block_ids) == 1
    assert not waiting


def test_admission_stops_at_the_first_request_whose_priority_is_not_below_the_bound():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admission = ReserveAdmission(kv)
    urgent, equal = request("urgent", 4, 5, priority=0), request("equal", 4, 5, priority=1)
    waiting = deque([urgent, equal])
    admitted = admission.admit(waiting, budget=100, num_seats=4, priority_below=1)
    assert [a.request for a in admitted] == [urgent]
    assert list(waiting) == [equal]


def test_a_prompt_is_admitted_only_if_the_whole_of_it_fits_even_when_its_first_chunk_would():
    """12 blocks of 4, 4 held: a 40-token prompt (10 blocks) waits although its 8-token chunk would fit."""
    kv = KVCacheManager(num_blocks=12, block_size=4)
    kv.allocate_slots(request("running", 16, 17), 16)
    admission = ReserveAdmission(kv)
    waiting = deque([request("long", 40, 41)])
    assert admission.admit(waiting, budget=8, num_seats=4) == []
    assert len(waiting) == 1 and kv.pool.num_free_blocks == 8


def test_the_reserve_for_future_output_shrinks_from_70_to_10_percent_over_600_steps():
    """One running request owes 1500 output blocks: a step before the end of the decay the reserve
    holds 10.1% of them (152 blocks), after it 10% (150), and a preemption restores 70% (1050)."""
    kv = KVCacheManager(num_blocks=2000, block_size=1)
    kv.allocate_slots(request("running", 1, 1502), 1)
    admission = ReserveAdmission(kv)
    for _ in range(599):
        admission.on_step()
    assert admission.reserved_blocks() == 152
    for _ in range(10):
        admission.on_step()
    assert admission.reserved_blocks() == 150
    admission.on_preemption()
    assert admission.reserved_blocks() == 1050


def test_a_waiting_request_one_block_short_does_not_fit_unless_a_block_is_freed_for_it():
    """4 blocks of 4, 2 held: a 12-token prompt (3 blocks) fits only if a running request gives one back."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots(request("running", 8, 9), 8)
    admission = ReserveAdmission(kv)
    waiting = request("waiting", 12, 13)
    assert not admission.fits(waiting)
    assert admission.fits(waiting, num_blocks_freed=1)
