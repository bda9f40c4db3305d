"""Tool calls in the api: the tools described to a template that does not render them, the grammar tool_choice
required or named asks for in each format, the format a model family's template picks, and the 400s for bad choices.
(Reading calls from replies: test_api_tool_parser.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from service.api.errors import ApiError
from service.api.grammar_cache import GrammarCache
from service.api.protocol import ChatCompletionRequest
from service.api.served_model import ServedModel
from service.api.tools import HERMES, LLAMA3_JSON, format_for
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
LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
LLAMA_NOW = '{"name": "now", "parameters": {}}'


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def grammar_of(body, tool_format=HERMES) -> str | None:
    body.calls_written_as(tool_format)
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


def test_auto_allows_any_text_but_a_begun_call_must_be_a_valid_one():
    grammar = grammar_of(chat(tools=[WEATHER, NOW]))
    assert grammar == grammar_of(chat(tools=[WEATHER, NOW], tool_choice="auto"))
    assert accepts(grammar, "It is sunny.") and accepts(grammar, "") and accepts(grammar, "a <b> </tool_call> c")
    assert accepts(grammar, f"Let me see. {CALL_WEATHER}\n{CALL_NOW} Done.")
    assert not accepts(grammar, "Calling <tool_call>\n{not json}\n</tool_call>")
    assert not accepts(grammar, CALL_NOW.replace("now", "later"))
    assert not accepts(grammar, CALL_WEATHER.replace('"c"', '"k"'))
    single = grammar_of(chat(tools=[WEATHER, NOW], parallel_tool_calls=False))
    assert accepts(single, f"{CALL_NOW} then text") and not accepts(single, f"{CALL_NOW}\n{CALL_NOW}")


def test_llama3_json_auto_allows_text_or_calls_from_the_start():
    grammar = grammar_of(chat(tools=[WEATHER, NOW]), LLAMA3_JSON)
    assert accepts(grammar, "It is sunny.") and accepts(grammar, "  It is {sunny}.")
    assert accepts(grammar, LLAMA_NOW) and accepts(grammar, f"\n{LLAMA_WEATHER}; {LLAMA_NOW}")
    assert not accepts(grammar, '{"answer": 42}') and not accepts(grammar, ' {"name": "later", "parameters": {}}')


def test_parameters_the_engine_cannot_enforce_leave_auto_unconstrained_and_refuse_required():
    unique = {"type": "function", "function": {"name": "tag", "parameters": {"type": "array", "uniqueItems": True}}}
    assert grammar_of(chat(tools=[unique])) is None
    with pytest.raises(ApiError) as caught:
        grammar_of(chat(tools=[unique], tool_choice="required"))
    assert caught.value.status_code == 400 and caught.value.param == "tools"


def test_none_another_constraint_or_ignore_eos_leave_the_calls_unconstrained():
    assert grammar_of(chat(tools=[WEATHER], tool_choice="none")) is None
    assert grammar_of(chat(tools=[WEATHER], ignore_eos=True)) is None
    json_only = grammar_of(chat(tools=[WEATHER], response_format={"type": "json_object"}))
    assert accepts(json_only, '{"a": 1}') and not accepts(json_only, CALL_NOW)


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


def test_llama3_json_required_calls_are_its_json_objects_separated_by_semicolons():
    grammar = grammar_of(chat(tools=[WEATHER, NOW], tool_choice="required"), LLAMA3_JSON)
    assert accepts(grammar, LLAMA_WEATHER) and accepts(grammar, LLAMA_NOW)
    assert accepts(grammar, f"{LLAMA_WEATHER}; {LLAMA_NOW}")
    assert not accepts(grammar, CALL_NOW)  # Hermes' markup is not this format
    assert not accepts(grammar, LLAMA_NOW.replace("parameters", "arguments"))
    named = grammar_of(chat(tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}))
    assert not accepts(named, LLAMA_NOW)
    named = grammar_of(
        chat(tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}), LLAMA3_JSON
    )
    assert accepts(named, LLAMA_NOW) and not accepts(named, LLAMA_WEATHER)


LLAMA_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if tools %}Respond with JSON, or <|python_tag|> for built-in tools{% endif %}"
)
QWEN_TEMPLATE = "{% if tools %}<tools>{{ tools | tojson }}</tools> in <tool_call></tool_call> tags{% endif %}"


def test_the_chat_template_picks_its_familys_format_unless_the_setting_names_one():
    assert format_for("auto", LLAMA_TEMPLATE) is LLAMA3_JSON
    assert format_for("auto", QWEN_TEMPLATE) is HERMES
    assert format_for("auto", tiny_model_info().chat_template) is HERMES  # SmolLM2's: shows no calls
    assert format_for("auto", None) is HERMES
    assert format_for("hermes", LLAMA_TEMPLATE) is HERMES
    assert format_for("llama3_json", QWEN_TEMPLATE) is LLAMA3_JSON


def test_a_template_without_tools_is_asked_for_the_chosen_format():
    model = ServedModel(tiny_model_info(), "llama3_json")
    assert model.tool_format is LLAMA3_JSON
    prompt = model.decode(model.encode_chat([{"role": "user", "content": "hi"}], [NOW]))
    assert '"parameters": dictionary of argument name' in prompt and "<tool_call>" not in prompt
