"""A maximal prompt is prefilled in chunks beside running decodes: no step leaves a decode out."""

from __future__ import annotations

import pytest

from service.contract import wire
from service.scheduler.scheduler import SchedulerConfig
from tests.support.scheduler_harness import Harness

MAX_MODEL_LEN = 1024
BUDGET = 64
NUM_DECODES = 4


@pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
def test_other_streams_get_a_token_every_step_while_a_maximal_prompt_prefills(overlapped):
    config = SchedulerConfig(num_blocks=128, block_size=16, max_num_batched_tokens=BUDGET, max_model_len=MAX_MODEL_LEN)
    harness = Harness(config, overlapped=overlapped)
    streaming = wire.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    decodes = [f"stream-{i}" for i in range(NUM_DECODES)]
    for request_id in decodes:
        harness.add(request_id, [5, 6, 7], streaming)
    while not all(len(harness.outputs[r]) >= 2 for r in decodes):
        harness.step()
    harness.add("maximal", list(range(1, MAX_MODEL_LEN)), wire.SamplingParams(max_tokens=1, temperature=0.0))
    num_prefill_steps = 0
    while not harness.outputs["maximal"]:
        before = {r: len(harness.outputs[r]) for r in decodes}
        output = harness.step()
        chunk = sum(
            r.num_scheduled_tokens for r in output.new_requests + output.running_requests if r.request_id == "maximal"
        )
        num_prefill_steps += chunk > 0
        assert chunk <= BUDGET - NUM_DECODES  # the decodes' tokens come out of the budget first
        assert all(len(harness.outputs[r]) == before[r] + 1 for r in decodes), "a stream missed a step"
    assert num_prefill_steps >= (MAX_MODEL_LEN - 1) // BUDGET  # it really went in chunks
