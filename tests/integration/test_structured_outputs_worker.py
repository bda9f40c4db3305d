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
from tests.support.grammar_walk import check_accepts_against_masks
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


def greedy_constrained(**fields) -> wire.SamplingParams:
    grammar = Constraint("json_schema", "test", canonical_json(SCHEMA)).grammar()
    return wire.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, grammar=grammar, **fields)


def run_batch(runner: ModelRunner, tokens_on_host: bool) -> dict[str, list[int]]:
    """A batch of greedy constrained requests (plain; asking logprobs; with a logit_bias toward a token the grammar
    refuses until the JSON is complete) beside a sampled constrained one and a free one: their tokens.
    `tokens_on_host` False masks every constrained row before its draw, as on a GPU."""
    runner.step_inputs.tokens_on_host = tokens_on_host
    refused_first = runner.model_info.eos_token_ids[0]  # the grammar refuses EOS before the JSON is complete
    try:
        engine = LocalEngine(runner, max_num_batched_tokens=64)
        engine.add("plain", PROMPT_IDS, greedy_constrained())
        engine.add("logprobs", PROMPT_IDS[2:], greedy_constrained(logprobs=2))
        engine.add("biased", PROMPT_IDS[1:], greedy_constrained(logit_bias={refused_first: 100.0}))
        engine.add("sampled", PROMPT_IDS[3:], constrained(seed=4))
        engine.add("free", PROMPT_IDS[:7], wire.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        return engine.run()
    finally:
        del runner.step_inputs.tokens_on_host  # back to the class's


def test_greedy_rows_checked_after_their_draw_give_the_masked_draws_tokens(runner, monkeypatch):
    """On a CPU a greedy constrained row draws first and asks its grammar after, drawing again under its mask
    only where refused: the tokens are the ones a draw under the mask gives, on the argmax path and the sampler's."""
    import worker.model_runner as model_runner

    redrawn: list[list[int]] = []
    redraw = model_runner.ModelRunner._redraw_refused

    def counted(self, logits, sampling, rows, sampled):
        before = [sampled[row].token_id for row in rows]
        redraw(self, logits, sampling, rows, sampled)
        redrawn.append([row for row, token in zip(rows, before) if sampled[row].token_id != token])

    monkeypatch.setattr(model_runner.ModelRunner, "_redraw_refused", counted)
    checked_after = run_batch(runner, tokens_on_host=True)
    assert sum(map(len, redrawn)) > 0, "some greedy row drew a token its grammar refused, and drew again"
    num_checked_steps = len(redrawn)
    masked_first = run_batch(runner, tokens_on_host=False)
    assert len(redrawn) == num_checked_steps, "masked before the draw, no row is checked after"
    assert checked_after == masked_first
    for request_id in ("plain", "logprobs", "biased", "sampled"):
        valid_until_eos(runner, checked_after[request_id])


@pytest.mark.parametrize("seed", range(3))
def test_the_check_after_a_draw_answers_as_the_mask_on_smollm2s_tokenizer(runner, seed):
    """BPE merges make forced text spellable in several ways; the mask allows one, and so must the check."""
    grammars = [
        Constraint("json_schema", "test", canonical_json(SCHEMA)).grammar(),
        Constraint("regex", "test", r"(19|20)[0-9]{2}-[a-z]{3,8}\.json").grammar(),
    ]
    for grammar in grammars:
        assert check_accepts_against_masks(runner.grammars, grammar, seed) > 0
