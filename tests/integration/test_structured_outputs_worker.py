"""Grammar-constrained requests on SmolLM2's ModelRunner, driven by the real scheduler in-process: the matcher
follows the tokens a request keeps through preemption and recompute, the overlapped step loop, prefix-cache hits
and unconstrained batch mates."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from tokenizers import Tokenizer

from service.api.constraints import Constraint, canonical_json
from service.contract import wire
from service.contract.config import load_settings
from tests.support.model_engine import LocalEngine
from worker.model_runner import ModelRunner

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "kind": {"enum": ["town", "village"]},
    },
    "required": ["city", "rank", "kind"],
    "additionalProperties": False,
}
PROMPT_IDS = [504, 3575, 282, 4649, 314, 253, 1345, 1185, 28, 284, 260, 1345, 282]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def runner(smollm_path):
    return ModelRunner(
        load_settings(model=os.fspath(smollm_path), num_kv_blocks=64, max_model_len=2048, dtype="float32")
    )


def constrained(seed: int) -> wire.SamplingParams:
    grammar = Constraint("json_schema", "test", canonical_json(SCHEMA)).grammar()
    return wire.SamplingParams(temperature=0.8, seed=seed, max_tokens=MAX_TOKENS, grammar=grammar)


def valid_until_eos(runner: ModelRunner, token_ids: list[int]) -> dict:
    """The JSON before the first EOS (LocalEngine runs on past it), checked against the schema."""
    eos = runner.model_info.eos_token_ids[0]
    assert eos in token_ids, "the grammar completed and allowed EOS within max_tokens"
    text = Tokenizer.from_str(runner.model_info.tokenizer_json).decode(token_ids[: token_ids.index(eos)])
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_a_preempted_constrained_request_resumes_with_identical_valid_output(runner):
    alone = LocalEngine(runner, max_num_batched_tokens=64)
    alone.add("json", PROMPT_IDS, constrained(seed=7))
    expected = alone.run()["json"]
    valid_until_eos(runner, expected)

    # Three prompts of one block each on 4 blocks of 16 tokens: the newest, "json", is preempted as they grow.
    crowded = LocalEngine(runner, max_num_batched_tokens=8, num_blocks=4, preemption_policy="lifo")
    crowded.add("other", PROMPT_IDS[::-1], wire.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    crowded.add("greedy", PROMPT_IDS[:5], wire.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    crowded.add("json", PROMPT_IDS, constrained(seed=7))

    assert crowded.run()["json"] == expected
    assert crowded.finished["json"].num_preemptions > 0


def test_the_overlapped_loop_gives_the_serial_loops_valid_outputs_beside_a_free_request(runner):
    def add_requests(engine: LocalEngine) -> None:
        engine.add("json-1", PROMPT_IDS, constrained(1))
        engine.add("free", PROMPT_IDS[:6], wire.SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS))
        engine.add("json-2", PROMPT_IDS[1:], constrained(2))

    serial = LocalEngine(runner, max_num_batched_tokens=16)  # prompts in chunks, beside decodes
    add_requests(serial)
    expected = serial.run()
    overlapped = LocalEngine(runner, max_num_batched_tokens=16, overlapped=True)
    add_requests(overlapped)
    assert overlapped.run_pipelined() == expected
    for request_id in ("json-1", "json-2"):
        valid_until_eos(runner, expected[request_id])


def test_a_prefix_cache_hit_changes_nothing_of_a_constrained_output(runner):
    long_prompt = PROMPT_IDS * 3  # two full blocks to find in the cache
    engine = LocalEngine(runner, max_num_batched_tokens=64)
    engine.add("first", long_prompt, constrained(5))
    first = engine.run()["first"]
    engine.add("again", long_prompt, constrained(5))
    assert engine.run()["again"] == first
    assert engine.finished["again"].num_cached_tokens >= 32
    valid_until_eos(runner, first)
