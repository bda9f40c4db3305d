"""Constraint fields of a request (OpenAI's response_format, vLLM's structured_outputs and guided_*): which one a
request names, the grammar built from it, and the 400 that names the field when it cannot be enforced."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from llguidance import LLMatcher, LLTokenizer

from service.api.constraints import Constraint
from service.api.errors import ApiError
from service.api.grammar_cache import GrammarCache
from service.api.protocol import ChatCompletionRequest, CompletionRequest
from tests.support.tiny_model import EOS_TOKEN_ID, tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def grammar_of(body, cache: GrammarCache | None = None) -> str | None:
    return asyncio.run((GrammarCache() if cache is None else cache).for_request(body))


def refusal(body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        grammar_of(body)
    assert caught.value.status_code == 400
    return caught.value


def accepts(grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole, as the tiny tokenizer spells it."""
    tokenizer = tiny_tokenizer()
    matcher = LLMatcher(LLTokenizer(tokenizer.to_str(), eos_token=EOS_TOKEN_ID), grammar)
    token_ids = tokenizer.encode(text, add_special_tokens=False).ids
    return matcher.consume_tokens(token_ids) and matcher.is_accepting()


@pytest.mark.parametrize(
    "fields",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
            }
        },
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},
    ],
)
def test_every_json_schema_field_gives_the_same_compact_grammar(fields):
    grammar = grammar_of(chat(**fields))
    assert accepts(grammar, '{"a": 12}')
    assert not accepts(grammar, '{"a":12}')  # separators are fixed: ", " and ": "
    assert not accepts(grammar, '{"a": 1.5}')
    assert not accepts(grammar, '{"a": 1, "b": 2}')


def test_json_object_takes_any_object_and_nothing_else():
    for fields in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        grammar = grammar_of(chat(**fields))
        assert accepts(grammar, '{"x": [1, "y"]}')
        assert not accepts(grammar, "[1]")


def test_regex_choice_and_grammar_fields_build_their_grammars():
    assert accepts(grammar_of(chat(structured_outputs={"regex": "[0-9]{3}"})), "123")
    assert not accepts(grammar_of(chat(guided_regex="[0-9]{3}")), "1234")
    choice = grammar_of(chat(guided_choice=["yes", 'say "no"']))
    assert accepts(choice, 'say "no"') and not accepts(choice, "maybe")
    lark = grammar_of(chat(structured_outputs={"grammar": 'start: "a"+ "b"'}))
    assert accepts(lark, "aaab") and not accepts(lark, "ba")
    gbnf = grammar_of(chat(guided_grammar='root ::= "yes" | "no"'))
    assert accepts(gbnf, "no") and not accepts(gbnf, "yesno")


def test_completions_take_the_same_fields():
    body = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert accepts(grammar_of(body), "{}")


def test_text_or_no_constraint_is_no_grammar():
    assert grammar_of(chat()) is None
    assert grammar_of(chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize(
    "fields, param, fragment",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
            "Invalid type",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "guided_json", "not"),
        ({"guided_json": "{not json"}, "guided_json", "not a JSON text"),
        ({"guided_json": "[1, 2]"}, "guided_json", "a JSON Schema is an object"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs.grammar", "missing"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", ""),
        ({"structured_outputs": {}}, "structured_outputs", "names no constraint"),
    ],
)
def test_a_constraint_that_cannot_be_enforced_is_a_400_naming_its_field(fields, param, fragment):
    error = refusal(chat(**fields))
    assert error.param == param
    assert fragment in error.message


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_object"}, "guided_regex": "a"},
        {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        {"guided_json": SCHEMA, "guided_grammar": 'start: "a"'},
    ],
)
def test_two_constraints_are_a_400_naming_both(fields):
    error = refusal(chat(**fields))
    assert "both constrain the output" in error.message
    assert error.param in error.message


def test_ignore_eos_with_a_constraint_is_a_400():
    assert refusal(chat(guided_regex="a+", ignore_eos=True)).param == "ignore_eos"


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
        {"guided_choice": []},
        {"structured_outputs": {"choice": "yes"}},
    ],
)
def test_malformed_constraint_fields_fail_validation(fields):
    with pytest.raises(ValueError):
        chat(**fields)


def test_the_same_schema_in_other_fields_or_spacing_is_one_cached_build():
    builds = []
    cache = GrammarCache(on_compiled=lambda kind, seconds: builds.append(kind))
    first = grammar_of(chat(guided_json=SCHEMA), cache)
    again = grammar_of(chat(structured_outputs={"json": json.dumps(SCHEMA, indent=4)}), cache)
    assert first == again
    assert builds == ["json_schema"]


def test_properties_come_in_the_order_the_schema_lists_them():
    listed = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    grammar = grammar_of(chat(guided_json=listed))
    assert accepts(grammar, '{"b": 1, "a": 2}')
    assert not accepts(grammar, '{"a": 2, "b": 1}')


def test_the_cache_keeps_at_most_its_entries_least_recently_used_out_first():
    cache = GrammarCache(max_entries=3)
    for width in range(10):
        grammar_of(chat(guided_regex=f"[0-9]{{{width + 1}}}"), cache)
    assert len(cache) == 3


def test_a_grammar_that_builds_too_long_is_a_400_and_others_are_served_meanwhile():
    release = threading.Event()

    class Slow(Constraint):
        def grammar(self) -> str:
            release.wait(5)
            return "never used"

    cache = GrammarCache(timeout_s=0.2, num_threads=2)

    async def both():
        slow = asyncio.create_task(cache.grammar(Slow("grammar", "guided_grammar", "slow")))
        started = time.perf_counter()
        fast = await cache.for_request(chat(guided_regex="[a-z]+"))
        fast_s = time.perf_counter() - started
        with pytest.raises(ApiError) as caught:
            await slow
        return fast, fast_s, caught.value

    try:
        fast, fast_s, error = asyncio.run(both())
    finally:
        release.set()
    assert accepts(fast, "abc") and fast_s < 0.2
    assert error.status_code == 400 and error.param == "guided_grammar" and "longer than" in error.message
