"""Tool calls in the api: the tools described to a template that does not render them, the grammar tool_choice
required or named asks for, Hermes calls parsed from a reply, whole or streamed, and the 400s for bad choices."""

from __future__ import annotations

import asyncio
import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from service.api.errors import ApiError
from service.api.grammar_cache import GrammarCache
from service.api.protocol import ChatCompletionRequest
from service.api.served_model import ServedModel
from service.api.tools import ToolCallStream, parse_hermes
from tests.support.tiny_model import EOS_TOKEN_ID, tiny_model_info, tiny_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL_NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def grammar_of(body) -> str | None:
    return asyncio.run(GrammarCache().for_request(body))


def accepts(grammar: str, text: str) -> bool:
    tokenizer = tiny_tokenizer()
    matcher = LLMatcher(LLTokenizer(tokenizer.to_str(), eos_token=EOS_TOKEN_ID), grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False).ids) and matcher.is_accepting()


def test_required_asks_for_calls_of_the_tools_with_their_arguments():
    grammar = grammar_of(chat(tools=[WEATHER, NOW], tool_choice="required"))
    assert accepts(grammar, CALL_WEATHER) and accepts(grammar, CALL_NOW)
    assert accepts(grammar, CALL_WEATHER + "\n" + CALL_NOW)  # parallel calls by default
    assert not accepts(grammar, "It is sunny.")
    assert not accepts(grammar, CALL_WEATHER.replace('"c"', '"k"'))
    assert not accepts(grammar, CALL_NOW.replace("now", "later"))
    single = grammar_of(chat(tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False))
    assert accepts(single, CALL_NOW) and not accepts(single, CALL_NOW + "\n" + CALL_NOW)


def test_a_named_function_is_the_only_call_allowed():
    named = {"type": "function", "function": {"name": "now"}}
    grammar = grammar_of(chat(tools=[WEATHER, NOW], tool_choice=named))
    assert accepts(grammar, CALL_NOW) and not accepts(grammar, CALL_WEATHER)


def test_auto_and_none_constrain_nothing():
    assert grammar_of(chat(tools=[WEATHER])) is None
    assert grammar_of(chat(tools=[WEATHER], tool_choice="auto")) is None
    assert grammar_of(chat(tools=[WEATHER], tool_choice="none")) is None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [NOW, NOW]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tools"),
    ],
)
def test_bad_tool_choices_are_a_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as caught:
        grammar_of(chat(**fields))
    assert caught.value.status_code == 400 and caught.value.param == param


def test_a_template_without_tools_gets_them_in_a_system_preamble():
    model = ServedModel(tiny_model_info())  # its template renders no tools
    prompt = model.decode(model.encode_chat([{"role": "user", "content": "hi"}], [WEATHER]))
    assert "<tool_call>" in prompt and json.dumps(WEATHER) in prompt
    assert prompt.index("get_weather") < prompt.index("hi")


def test_hermes_calls_are_parsed_and_the_rest_is_content():
    content, calls = parse_hermes(f"Let me look.\n{CALL_WEATHER}\n{CALL_NOW}", {"get_weather", "now"})
    assert content == "Let me look."
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("now", {}),
    ]
    assert len({call.id for call in calls}) == 2
    assert parse_hermes(CALL_WEATHER, {"now"}) == (CALL_WEATHER, [])  # an unknown function stays text
    assert parse_hermes("<tool_call>\n{not json}\n</tool_call>", {"now"})[1] == []


def test_a_stream_holds_back_from_a_possible_call_on():
    stream = ToolCallStream({"now"})
    pieces = ["Sure", ". <tool", '_call>\n{"name": "now", ', '"arguments": {}}\n</tool_call>']
    assert [stream.feed(piece) for piece in pieces] == ["Sure", ". ", "", ""]
    tail, calls = stream.finish()
    assert tail == "" and [call.name for call in calls] == ["now"]
    plain = ToolCallStream({"now"})
    assert plain.feed("a <") == "a " and plain.feed("b") == "<b"
    assert plain.finish() == ("", [])
