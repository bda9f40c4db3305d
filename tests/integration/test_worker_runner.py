"""ModelRunner behaviour on SmolLM2 beyond matching transformers: seeds, logprobs, errors, cache size."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_worker.kv_cache import block_bytes, num_blocks_for
from gpu_worker.model_runner import ModelRunner
from service import wire
from service.config import load_settings

PROMPT_IDS = [504, 3575, 282, 4649, 314, 253, 1345, 1185, 28, 284, 260, 1345, 282]


@pytest.fixture(scope="module")
def runner(smollm_path):
    return ModelRunner(load_settings(model=os.fspath(smollm_path), num_kv_blocks=64, max_model_len=2048))


def new_request(request_id: str, sampling: wire.SamplingParams, block_ids: list[int]) -> wire.NewRequest:
    return wire.NewRequest(
        request_id=request_id,
        token_ids=PROMPT_IDS,
        num_prompt_tokens=len(PROMPT_IDS),
        sampling=sampling,
        block_ids=block_ids,
        num_computed_tokens=0,
        num_scheduled_tokens=len(PROMPT_IDS),
    )


def test_seeded_sampling_repeats_with_other_batch_mates_and_after_preemption(runner, scheduler_double):
    seeded = wire.SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    alone = scheduler_double(runner, token_budget=64)
    alone.add("seeded", PROMPT_IDS, seeded)
    expected = alone.run()["seeded"]

    crowded = scheduler_double(runner, token_budget=8)
    crowded.add("other", PROMPT_IDS[::-1], wire.SamplingParams(temperature=1.0, max_tokens=12))
    crowded.add("seeded", PROMPT_IDS, seeded)
    crowded.add("greedy", PROMPT_IDS[:5], wire.SamplingParams(temperature=0.0, max_tokens=12))

    assert crowded.run(preempt={"seeded": 5})["seeded"] == expected


def test_logprobs_are_sorted_and_include_the_chosen_token(runner):
    sampling = wire.SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    step = wire.SchedulerOutput(step_id=1, new_requests=[new_request("lp", sampling, [0])])

    (sampled,) = runner.execute(step).sampled
    runner.execute(wire.SchedulerOutput(step_id=2, finished_request_ids=["lp"]))

    top = sampled.top_logprobs
    assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True) and len(top) == 5
    assert top[0].token_id == sampled.token_id and top[0].logprob == pytest.approx(sampled.logprob)
    assert sum(np.exp(t.logprob) for t in top) <= 1.0 + 1e-6


def test_a_step_naming_an_unknown_request_returns_an_error_and_the_worker_keeps_serving(runner):
    bad = wire.SchedulerOutput(step_id=3, running_requests=[wire.RunningRequest("ghost", [], 1)])
    good = wire.SchedulerOutput(step_id=4, new_requests=[new_request("ok", wire.SamplingParams(temperature=0.0), [1])])

    assert "ghost" in runner.execute(bad).error
    result = runner.execute(good)

    assert result.error is None and len(result.sampled) == 1


def test_a_step_with_too_few_blocks_is_refused_not_computed(runner):
    step = wire.SchedulerOutput(
        step_id=5,
        new_requests=[
            wire.NewRequest(
                request_id="short",
                token_ids=PROMPT_IDS * 2,
                num_prompt_tokens=26,
                sampling=wire.SamplingParams(),
                block_ids=[2],
                num_computed_tokens=0,
                num_scheduled_tokens=26,
            )
        ],
    )

    assert "too few blocks" in runner.execute(step).error


def test_model_info_caps_the_length_and_names_the_special_tokens(runner):
    info = runner.model_info
    assert info.max_model_len == 2048 and info.vocab_size == 49152
    assert info.eos_token_ids == [2] and info.bos_token_id == 1 and info.add_bos_token is False
    assert (info.name, info.aliases) == ("SmolLM2-135M-Instruct", ["SmolLM2-135M-Instruct.Q4_1"])


def test_kv_cache_is_sized_from_memory_unless_a_block_count_is_set(runner):
    config = runner.model.config
    per_block = 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 4
    assert block_bytes(config, 16) == per_block
    assert num_blocks_for(config, 16, 100 * per_block + 1, None) == 100
    assert num_blocks_for(config, 16, 100 * per_block, 7) == 7
    assert runner.num_kv_blocks == 64 and runner.kv_cache.key_caches[0].shape == [64, 16, 3, 64]


def test_a_request_with_nonsense_sampling_is_refused_alone_and_its_batch_mates_are_computed(runner):
    greedy = wire.SamplingParams(temperature=0.0)
    first = wire.SchedulerOutput(
        step_id=20,
        new_requests=[
            new_request("nonsense", wire.SamplingParams(logprobs=100000), [10]),
            new_request("honest", greedy, [11]),
        ],
    )
    result = runner.execute(first)
    assert result.error is None and [t.request_id for t in result.sampled] == ["honest"]  # no token: ended alone

    # The scheduler may have scheduled it again before it learnt: still not computed, not an unknown request.
    again = [wire.RunningRequest("nonsense", [], 1), wire.RunningRequest("honest", [], 1)]
    result = runner.execute(wire.SchedulerOutput(step_id=21, running_requests=again))
    assert result.error is None and [t.request_id for t in result.sampled] == ["honest"]
    runner.execute(wire.SchedulerOutput(step_id=22, finished_request_ids=["nonsense", "honest"]))
    assert "nonsense" not in runner.refused_request_ids
