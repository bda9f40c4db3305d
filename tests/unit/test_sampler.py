"""The sampler on hand-made logits: seeds, greedy, the distribution it draws from, penalties, logprobs.

The draws' tests run on each draw the worker serves with: Paddle's ops (the reference, and the draw behind the
CUDA kernels) and the custom CPU op bs_sample_rows on each instruction set (the worker's draw on a CPU; built on
first use, so those cases are integration tests)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from service.contract import wire
from tests.support.host_copies import HostCopies
from tests.support.isa_kernels import ISA_CAPS, custom_kernels_on
from worker.inputs.step_inputs import RequestState
from worker.kernels.protocol import Kernels
from worker.kernels.reference import PaddleKernels
from worker.sample.penalties import apply_penalties
from worker.sample.sampler import Sampler

VOCAB_SIZE = 64
# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI_SQUARE_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 5: 20.515}


@pytest.fixture(
    scope="module",
    params=["paddle", *(pytest.param(f"custom-{cap}", marks=pytest.mark.integration) for cap in ISA_CAPS)],
)
def kernels(request) -> Kernels:
    """The kernels whose argmax_rows and sample_rows a served Sampler draws with."""
    return PaddleKernels() if request.param == "paddle" else custom_kernels_on(request.param.removeprefix("custom-"))


def served(kernels: Kernels, seed: int | None = None) -> Sampler:
    """A sampler drawing as the worker's does with these kernels (worker/startup.py)."""
    return Sampler(seed, argmax=kernels.argmax_rows, sample_rows=kernels.sample_rows)


def request(request_id="r", token_ids=(1, 2, 3), num_prompt_tokens=None, **sampling) -> RequestState:
    token_ids = list(token_ids)
    prompt = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
    return RequestState(request_id, token_ids, prompt, wire.SamplingParams(**sampling), [], len(token_ids))


def random_logits(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, size=(rows, VOCAB_SIZE)).astype(np.float32)


def sample(logits: np.ndarray, requests: list[RequestState], sampler: Sampler) -> list[wire.SampledToken]:
    return sampler.sample(paddle.to_tensor(logits), requests)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def draw_counts(kernels: Kernels, logits_row: np.ndarray, num_draws: int, **sampling) -> np.ndarray:
    logits = np.repeat(logits_row[None], num_draws, axis=0)
    params = wire.SamplingParams(**sampling)  # one for all: building 20,000 took most of a test's time
    requests = [RequestState(str(i), [1, 2, 3], 3, params, [], 3) for i in range(num_draws)]
    tokens = [t.token_id for t in sample(logits, requests, served(kernels, seed=7))]
    return np.bincount(tokens, minlength=len(logits_row))


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(top_p=0.5), dict(top_k=5, min_p=0.05)])
def test_a_seeded_request_draws_the_same_token_whatever_its_batch_mates(kernels, params):
    logits = random_logits(4)
    seeded = request("seeded", token_ids=range(17), seed=99, **params)
    mates = [request("a", top_k=3), request("b", temperature=0.0, repetition_penalty=1.3), request("c", top_p=0.2)]

    alone = sample(logits[:1], [seeded], served(kernels))[0].token_id
    crowded = sample(logits, [seeded, *mates], served(kernels, seed=1))[0].token_id
    last = sample(logits[[3, 2, 1, 0]], [*mates[::-1], seeded], served(kernels, seed=2))[3].token_id

    assert alone == crowded == last


def test_a_recomputed_request_redraws_the_same_tokens_from_its_seed_and_length(kernels):
    logits = random_logits(1)

    def tokens_by_length(sampler: Sampler) -> dict[int, int]:
        return {n: sample(logits, [request(token_ids=range(n), seed=5)], sampler)[0].token_id for n in range(10, 40)}

    first, recomputed = tokens_by_length(served(kernels, seed=1)), tokens_by_length(served(kernels, seed=2))

    assert first == recomputed
    assert len(set(first.values())) > 1, "the draw must change as the sequence grows"


def test_top_k_of_one_is_greedy(kernels):
    logits = random_logits(16)
    requests = [request(str(i), top_k=1, temperature=1.5) for i in range(16)]

    assert [t.token_id for t in sample(logits, requests, served(kernels))] == list(logits.argmax(axis=-1))


def test_temperature_zero_is_argmax_of_the_penalised_logits(kernels):
    logits = np.zeros((1, VOCAB_SIZE), dtype=np.float32)
    logits[0, 3], logits[0, 4] = 2.0, 1.5

    (token,) = sample(logits, [request(token_ids=[3], temperature=0.0, repetition_penalty=2.0)], served(kernels))

    assert token.token_id == 4


def test_a_greedy_batch_draws_each_rows_argmax_in_one_copy_to_the_host(kernels, monkeypatch):
    logits = random_logits(5)
    on_device = paddle.to_tensor(logits)
    copies = HostCopies(monkeypatch)

    sampled = served(kernels).sample(
        on_device, [request(str(i), temperature=0.0, top_k=3, top_p=0.5) for i in range(5)]
    )

    assert [t.token_id for t in sampled] == list(logits.argmax(axis=-1)) and len(copies) == 1
    assert all(t.logprob is None and t.top_logprobs is None for t in sampled)


@pytest.mark.parametrize(
    "asks",
    [
        {"repetition_penalty": 2.0},
        {"presence_penalty": 5.0},
        {"frequency_penalty": 5.0},
        {"logit_bias": {4: 10.0}},
        {"logprobs": 1},
    ],
    ids=lambda asks: next(iter(asks)),
)
def test_one_greedy_row_asking_for_more_gets_it_beside_plain_greedy_rows(kernels, asks):
    """A batch of plain greedy rows draws the argmax alone; a row with a penalty, a logit_bias or logprobs takes
    the batch through the general path, and gets what it asked while the others get their argmax."""
    logits = random_logits(3)
    logits[2, 3], logits[2, 4] = 50.0, 49.0  # row 2: token 3 first, token 4 a close second
    asking = request("asks", token_ids=[3], num_prompt_tokens=0, temperature=0.0, **asks)  # 3 seen, as output

    sampled = sample(logits, [request("a", temperature=0.0), request("b", temperature=0.0), asking], served(kernels))

    assert [t.token_id for t in sampled[:2]] == list(logits[:2].argmax(axis=-1))
    if "logprobs" in asks:
        assert sampled[2].token_id == 3 and sampled[2].logprob is not None and len(sampled[2].top_logprobs) == 1
    else:
        assert sampled[2].token_id == 4  # the penalty or bias moved the argmax


def test_temperature_sampling_follows_the_softmax(kernels):
    logits_row = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 2.0], dtype=np.float32)
    counts = draw_counts(kernels, logits_row, 20000, temperature=0.7)

    probs = np.exp(logits_row / 0.7) / np.exp(logits_row / 0.7).sum()
    assert chi_square(counts, probs) < CHI_SQUARE_CRITICAL_0_001[5]


def test_top_p_draws_from_the_smallest_set_holding_that_mass_renormalised(kernels):
    logits_row = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], dtype=np.float32))
    counts = draw_counts(kernels, logits_row, 20000, top_p=0.8)

    assert counts[3:].sum() == 0  # 0.4 + 0.3 + 0.15 >= 0.8
    assert chi_square(counts[:3], np.array([0.4, 0.3, 0.15]) / 0.85) < CHI_SQUARE_CRITICAL_0_001[2]


def test_top_k_and_min_p_cut_the_tail(kernels):
    logits_row = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], dtype=np.float32))

    assert draw_counts(kernels, logits_row, 2000, top_k=2)[2:].sum() == 0
    assert draw_counts(kernels, logits_row, 2000, min_p=0.3)[3:].sum() == 0  # 0.1 < 0.3 * 0.4


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = np.array([[2.0, -2.0, 2.0, -2.0]], dtype=np.float32)
    seen_in_prompt_and_output = request(token_ids=[0, 1], num_prompt_tokens=1, repetition_penalty=2.0)

    penalised = apply_penalties(paddle.to_tensor(logits), [seen_in_prompt_and_output]).numpy()

    np.testing.assert_allclose(penalised, [[1.0, -4.0, 2.0, -2.0]])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = np.zeros((2, 4), dtype=np.float32)
    penalised_request = request(
        token_ids=[3, 0, 1, 1, 1], num_prompt_tokens=2, presence_penalty=0.5, frequency_penalty=0.25
    )
    neutral_request = request(token_ids=[0, 1, 2], num_prompt_tokens=1)

    penalised = apply_penalties(paddle.to_tensor(logits), [penalised_request, neutral_request]).numpy()

    np.testing.assert_allclose(penalised, [[0.0, -(0.5 + 3 * 0.25), 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_logprobs_come_from_the_raw_logits_with_the_top_k_sorted(kernels):
    logits = random_logits(2)
    requests = [
        request("k3", logprobs=3, temperature=0.5, repetition_penalty=1.5),
        request("none", temperature=0.0),
    ]

    with_logprobs, without = sample(logits, requests, served(kernels))

    raw_logprobs = logits[0] - np.log(np.exp(logits[0]).sum())
    assert with_logprobs.logprob == pytest.approx(raw_logprobs[with_logprobs.token_id], abs=1e-5)
    best = np.argsort(-raw_logprobs)[:3]
    assert [t.token_id for t in with_logprobs.top_logprobs] == list(best)
    assert [t.logprob for t in with_logprobs.top_logprobs] == pytest.approx(raw_logprobs[best], abs=1e-5)
    assert without.logprob is None and without.top_logprobs is None


@pytest.mark.parametrize(
    "params",
    [
        dict(top_p=1e-300),  # 0 in float32
        dict(top_p=0.0),
        dict(top_p=1e-300, top_k=3),
        dict(min_p=1.0),
        dict(min_p=5.0),  # above 1: nothing would pass a floor over the top probability
        dict(min_p=1.0, top_p=1e-300, top_k=2),
    ],
    ids=repr,
)
def test_truncation_never_excludes_the_most_likely_token(kernels, params):
    logits = random_logits(32, seed=3)
    requests = [request(str(i), temperature=1.0, **params) for i in range(32)]

    tokens = [t.token_id for t in sample(logits, requests, served(kernels, seed=11))]

    assert tokens == list(logits.argmax(axis=-1))


def test_a_vanishing_top_p_keeps_the_top_token_even_when_it_holds_almost_all_the_mass(kernels):
    logits_row = np.full(VOCAB_SIZE, -30.0, dtype=np.float32)
    logits_row[5] = 30.0

    counts = draw_counts(kernels, logits_row, 200, top_p=1e-300)

    assert counts[5] == 200


def test_sampling_copies_to_the_host_once_and_leaves_the_tokens_on_the_device(kernels, monkeypatch):
    """On a GPU every copy to the host waits for the device: one per step, for tokens and logprobs together."""
    logits = random_logits(4)
    requests = [
        request("greedy", temperature=0.0, logprobs=2),
        request("plain", temperature=0.9),
        request("top_k", top_k=5, logprobs=0),
        request("top_p", top_p=0.5, seed=3),
    ]
    on_device = paddle.to_tensor(logits)
    copies = HostCopies(monkeypatch)

    draw = served(kernels, seed=4).draw(on_device, requests)
    assert len(copies) == 0
    sampled = draw.fetch()

    assert len(copies) == 1
    monkeypatch.undo()
    assert [t.token_id for t in sampled] == draw.tokens.numpy().tolist()
    assert sampled[0].token_id == logits[0].argmax() and len(sampled[0].top_logprobs) == 2
    assert sampled[2].logprob is not None and sampled[2].top_logprobs == [] and sampled[1].logprob is None
