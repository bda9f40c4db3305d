"""The worker's grammar path without a model: matchers from the api's grammars, their masks on random logits, the
sampler's draw under them, and matchers rebuilt by replay (a preempted request's)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import paddle
import pytest

from service.api.constraints import Constraint, canonical_json
from service.contract import wire
from tests.support.grammar_walk import check_accepts_against_masks
from tests.support.tiny_model import EOS_TOKEN_ID, tiny_model_info, tiny_tokenizer
from worker.inputs.step_inputs import RequestState
from worker.sample.grammar import GrammarMatchers, GrammarRefused, PendingMatcher
from worker.sample.sampler import Sampler
from worker.sample.token_mask import TokenMask, allowed_tokens, unpacked_bits

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "pet": {"anyOf": [{"type": "null"}, {"const": "cat"}]},
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def matchers() -> GrammarMatchers:
    return GrammarMatchers(tiny_model_info())


def grammar(kind: str, text: str) -> str:
    return Constraint(kind, "test", text).grammar()


def state(request_id: str, grammar_text: str | None, matchers: GrammarMatchers, **sampling) -> RequestState:
    request = RequestState(request_id, [5, 6], 2, wire.SamplingParams(grammar=grammar_text, **sampling), [], 2)
    request.matcher = None if grammar_text is None else matchers.start(grammar_text, [])
    return request


def generate(requests: list[RequestState], matchers: GrammarMatchers, seed: int) -> list[list[int]]:
    """Draw from random logits until every request has drawn EOS or MAX_TOKENS, as the worker's step does."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(seed=seed)
    vocab_size = matchers.vocab_size
    outputs: list[list[int]] = [[] for _ in requests]
    live = list(range(len(requests)))
    for _ in range(MAX_TOKENS):
        batch = [requests[i] for i in live]
        rows = np.array([row for row, r in enumerate(batch) if r.matcher is not None], dtype=np.int64)
        mask = TokenMask(rows, matchers.fill([batch[row].matcher for row in rows])) if len(rows) else None
        logits = paddle.to_tensor(rng.normal(0, 3, size=(len(batch), vocab_size)).astype(np.float32))
        for row, token in enumerate(sampler.sample(logits, batch, mask)):
            request = batch[row]
            request.token_ids.append(token.token_id)
            outputs[live[row]].append(token.token_id)
            if request.matcher is not None:
                matchers.advance(request.matcher, token.token_id, request.request_id)
        live = [i for i in live if outputs[i][-1] != EOS_TOKEN_ID]
        if not live:
            break
    return outputs


def text_of(token_ids: list[int]) -> str:
    assert token_ids[-1] == EOS_TOKEN_ID, "the output ends with EOS, where the grammar accepts"
    return tiny_tokenizer().decode(token_ids[:-1], skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(3))
def test_random_logits_under_a_schema_always_give_valid_json(matchers, seed):
    schema_grammar = grammar("json_schema", canonical_json(SCHEMA))
    requests = [state(f"r{i}", schema_grammar, matchers, temperature=1.0) for i in range(4)]
    for output in generate(requests, matchers, seed):
        jsonschema.validate(json.loads(text_of(output)), SCHEMA)


def test_constrained_and_free_rows_share_a_batch(matchers):
    choice = grammar("choice", json.dumps(["red", "green", "blue"]))
    regex = grammar("regex", "[0-9]{2}-[a-c]")
    requests = [
        state("choice", choice, matchers, temperature=1.0),
        state("free", None, matchers, temperature=1.0),
        state("regex", regex, matchers, temperature=0.0),
        state("free-greedy", None, matchers, temperature=0.0),
    ]
    outputs = generate(requests, matchers, seed=7)
    assert text_of(outputs[0]) in {"red", "green", "blue"}
    assert len(outputs[1]) == MAX_TOKENS or outputs[1][-1] == EOS_TOKEN_ID  # the free rows draw from everything
    text = text_of(outputs[2])
    assert len(text) == 4 and text[:2].isdigit() and text[2] == "-" and text[3] in "abc"


def test_logit_bias_cannot_bring_back_a_token_the_grammar_forbids(matchers):
    digits = grammar("regex", "[0-9]")
    letter_a = tiny_tokenizer().token_to_id("a")
    request = state("r", digits, matchers, temperature=0.0, logit_bias={letter_a: 100.0})
    text = text_of(generate([request], matchers, seed=1)[0])
    assert text.isdigit()


def test_eos_is_allowed_exactly_where_the_grammar_accepts(matchers):
    vocab_size = matchers.vocab_size
    matcher = matchers.start(grammar("regex", "ab?"), [])
    assert not allowed_tokens(matchers.fill([matcher]), vocab_size)[0, EOS_TOKEN_ID]
    matchers.advance(matcher, tiny_tokenizer().token_to_id("a"), "r")
    allowed = allowed_tokens(matchers.fill([matcher]), vocab_size)[0]
    assert allowed[EOS_TOKEN_ID] and allowed[tiny_tokenizer().token_to_id("b")]
    matchers.advance(matcher, tiny_tokenizer().token_to_id("b"), "r")
    assert np.flatnonzero(allowed_tokens(matchers.fill([matcher]), vocab_size)[0]).tolist() == [EOS_TOKEN_ID]


def test_a_replayed_matcher_masks_as_the_one_that_consumed_the_tokens(matchers):
    schema_grammar = grammar("json_schema", canonical_json(SCHEMA))
    output = generate([state("r", schema_grammar, matchers, temperature=1.0)], matchers, seed=3)[0]
    stepwise = matchers.start(schema_grammar, [])
    for cut, token in enumerate(output[:-1]):
        replayed = matchers.start(schema_grammar, output[:cut])
        assert np.array_equal(matchers.fill([replayed]), matchers.fill([stepwise]))
        matchers.advance(stepwise, token, "r")


def test_an_output_the_grammar_rejects_is_refused_at_replay(matchers):
    digits = grammar("regex", "[0-9]+")
    with pytest.raises(GrammarRefused, match="does not match"):
        matchers.start(digits, tiny_tokenizer().encode("abc", add_special_tokens=False).ids)


def test_an_uncompilable_grammar_is_refused(matchers):
    with pytest.raises(GrammarRefused, match="does not compile"):
        matchers.start("start: missing_rule", [])


def test_templates_are_kept_up_to_their_number():
    bounded = GrammarMatchers(tiny_model_info(), max_templates=2)
    for width in range(1, 6):
        bounded.start(grammar("regex", f"[0-9]{{{width}}}"), [])
    assert len(bounded._templates) == 2


@pytest.mark.parametrize(
    "kind, text",
    [
        ("json_schema", canonical_json(SCHEMA)),
        ("regex", "[0-9]{2}-(ab|abc)x?"),
        ("choice", json.dumps(["red", "green", "greenish"])),
        ("grammar", 'start: "a" item+ "!"\nitem: "b" | "cd"'),
    ],
)
def test_a_greedy_rows_check_after_its_draw_answers_as_its_mask(matchers, kind, text):
    for seed in range(3):
        assert check_accepts_against_masks(matchers, grammar(kind, text), seed) > 0


@pytest.mark.parametrize("width", [1, 31, 32, 33, 100])
def test_bits_unpacked_in_paddle_ops_are_the_numpy_reference(width):
    """The GPU's unpack of a mask (token_mask.unpacked_bits), run here in Paddle's CPU ops."""
    words = np.random.default_rng(width).integers(-(2**31), 2**31, size=(3, (width + 31) // 32)).astype(np.int32)
    unpacked = unpacked_bits(paddle.to_tensor(words), width).numpy()
    np.testing.assert_array_equal(unpacked, allowed_tokens(words, width))


def test_a_template_not_built_builds_off_the_loop_and_its_matcher_masks_as_one_built_at_once():
    fresh = GrammarMatchers(tiny_model_info())
    regex = grammar("regex", "[0-9]{2}-[a-c]")
    prefix = tiny_tokenizer().encode("4", add_special_tokens=False).ids
    pending = fresh.begin(regex, prefix)
    assert isinstance(pending, PendingMatcher)
    matcher = fresh.resolve(pending)
    assert np.array_equal(fresh.fill([matcher]), fresh.fill([GrammarMatchers(tiny_model_info()).start(regex, prefix)]))
    again = fresh.begin(regex, [])
    assert not isinstance(again, PendingMatcher), "a built template is cached: the next request starts at once"


def test_a_template_that_fails_to_build_is_refused_at_resolve_and_not_cached():
    fresh = GrammarMatchers(tiny_model_info())
    pending = fresh.begin("start: missing_rule", [])
    with pytest.raises(GrammarRefused, match="does not compile"):
        fresh.resolve(pending)
    assert isinstance(fresh.begin("start: missing_rule", []), PendingMatcher)


def test_builds_whose_requests_never_sampled_land_in_the_bounded_cache():
    bounded = GrammarMatchers(tiny_model_info(), max_templates=2)
    for width in range(1, 6):
        bounded.begin(grammar("regex", f"[0-9]{{{width}}}"), [])  # requests that ended before they sampled
    bounded._build_thread.submit(lambda: None).result()  # the builds before it have finished
    bounded.begin(grammar("regex", "[a-z]"), [])
    assert len(bounded._templates) == 2 and len(bounded._building) == 1
