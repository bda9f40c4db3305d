"""Tool calls read from replies, whole and streamed, in Hermes' and Llama 3's formats: a stream's deltas join into the
whole reply's calls and content however its text is cut, markup never goes out as content, each call is announced
once (id and name) and then only its arguments follow, and what is not a call stays content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.json_scanner import JsonScanner
from service.api.tool_parser import ParsedDelta, ToolCallParser, parse_reply
from service.api.tools import HERMES, LLAMA3_JSON

NAMES = {"get_weather", "now"}
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL_NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
REPLIES = {
    "text, two calls, text": f"Let me look.\n{CALL_WEATHER}\n{CALL_NOW}\nDone.",
    "calls alone": CALL_WEATHER + CALL_NOW,
    "odd layout": (
        '<tool_call>{ "arguments" :{"a":[1 ,2.5e-3,{"b":null}],"s":"x \\" \\u00e9 }"} ,"name":"now"}</tool_call>'
    ),
    "no calls": "Just text with a < and <tool and </tool_call> in it ",
    "not JSON": "<tool_call>\n{not json}\n</tool_call> after",
    "unknown function": '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
    "broken after the name": '<tool_call>{"name": "now", "arguments": {"a": 1 2}}</tool_call>tail',
    "cut in the arguments": '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',
    "unclosed": '<tool_call>{"name": "now", "arguments": {"x": true}}',
    "cut in the name": 'Sure. <tool_call>\n{"name": "get_',
}
LLAMA_REPLIES = {
    "one call": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
    "python tag, two calls": '<|python_tag|>{"name": "now", "parameters": {}}; {"name": "now", "parameters": {"n": 2}}',
    "text": "It is sunny {in} Paris.",
    "an object that is no call": '  {"answer": 42}',
    "call then text": '{"name": "now", "arguments": {}}\nThat is the time.',
    "cut in the name": '{"name": "get_',
    "cut in an object that is no call": '{"answer": 4',
}


def streamed(text: str, cuts: list[int], tool_format=HERMES) -> tuple[str, list[dict], list[ParsedDelta]]:
    """The content and calls a client joins from the deltas of `text` cut at `cuts`, and the deltas."""
    parser = ToolCallParser(tool_format, NAMES)
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas = [parser.feed(text[start:end]) for start, end in zip(bounds, bounds[1:])] + [parser.finish()]
    calls: dict[int, dict] = {}
    for delta in deltas:
        for call in delta.calls:
            joined = calls.setdefault(call.index, {"id": call.id, "name": call.name, "arguments": ""})
            joined["arguments"] += call.arguments
    return "".join(delta.content for delta in deltas), [calls[index] for index in sorted(calls)], deltas


def whole(text: str, tool_format=HERMES) -> tuple[str, list[dict]]:
    content, calls = parse_reply(text, tool_format, NAMES)
    return content or "", [{"name": call.name, "arguments": call.arguments} for call in calls]


def without_ids(calls: list[dict]) -> list[dict]:
    return [{"name": call["name"], "arguments": call["arguments"]} for call in calls]


def test_hermes_calls_are_parsed_and_the_rest_is_content():
    content, calls = parse_reply(REPLIES["text, two calls, text"], HERMES, NAMES)
    assert content == "Let me look.\nDone."  # whitespace before a call is dropped, after one kept between texts
    assert [(call.name, call.arguments) for call in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'),
        ("now", "{}"),
    ]
    assert len({call.id for call in calls}) == 2 and all(call.id.startswith("call_") for call in calls)
    assert parse_reply(CALL_NOW, HERMES, NAMES)[0] is None  # nothing but calls: content is null


def test_arguments_are_laid_out_as_json_dumps_lays_them_with_strings_and_numbers_as_written():
    _, calls = whole(REPLIES["odd layout"])
    assert calls == [{"name": "now", "arguments": '{"a": [1, 2.5e-3, {"b": null}], "s": "x \\" \\u00e9 }"}'}]
    assert json.loads(calls[0]["arguments"]) == {"a": [1, 0.0025, {"b": None}], "s": 'x " é }'}


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_one_character_per_delta_joins_into_the_whole_reply(name):
    text = REPLIES[name]
    content, calls, deltas = streamed(text, list(range(len(text))))
    assert (content, without_ids(calls)) == whole(text)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(REPLIES)), cuts=st.lists(st.integers(0, 120), max_size=12))
def test_any_cutting_joins_into_the_whole_reply(name, cuts):
    text = REPLIES[name]
    content, calls, _ = streamed(text, [cut for cut in cuts if cut < len(text)])
    assert (content, without_ids(calls)) == whole(text)


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<|python_tag|>", '{"name": "now", "arguments": ', '{"name": "get_weather", ',
    '"parameters": ', '"name": "nope"', "{", "}", "[", "]", '"a"', '"\\u00e9\\""', ":", ",", ";", "1.5", "-", "true",
    "hi", " ", "\n", "<", ">", '"',
]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    cuts=st.lists(st.integers(0, 400), max_size=20),
    tool_format=st.sampled_from([HERMES, LLAMA3_JSON]),
)
def test_any_text_however_cut_streams_into_what_the_whole_reply_reads(pieces, cuts, tool_format):
    text = "".join(pieces)
    content, calls, deltas = streamed(text, [cut for cut in cuts if cut < len(text)], tool_format)
    assert (content, without_ids(calls)) == whole(text, tool_format)
    assert all(call.id is None or call.name in NAMES for delta in deltas for call in delta.calls)


@pytest.mark.parametrize("name", sorted(LLAMA_REPLIES))
def test_llama3_replies_join_the_same_one_character_at_a_time(name):
    text = LLAMA_REPLIES[name]
    content, calls, _ = streamed(text, list(range(len(text))), LLAMA3_JSON)
    assert (content, without_ids(calls)) == whole(text, LLAMA3_JSON)


def test_markup_never_goes_out_as_content_and_each_call_is_announced_once():
    text = REPLIES["text, two calls, text"]
    _, _, deltas = streamed(text, list(range(len(text))))
    assert "".join(delta.content for delta in deltas) == "Let me look.\nDone."
    pieces = [call for delta in deltas for call in delta.calls]
    firsts = [call for call in pieces if call.id is not None]
    assert [(call.index, call.name, call.arguments) for call in firsts] == [(0, "get_weather", ""), (1, "now", "")]
    assert all(call.name is None for call in pieces if call.id is None)
    indexes = [call.index for call in pieces]
    assert indexes == sorted(indexes)  # a call's pieces all come before the next call's


def test_the_call_is_announced_as_soon_as_its_name_is_read():
    parser = ToolCallParser(HERMES, NAMES)
    assert parser.feed('Hi <tool_call>\n{"name": "now') == ParsedDelta(content="Hi")
    announced = parser.feed('", "argu')
    assert [(call.index, call.name, call.arguments) for call in announced.calls] == [(0, "now", "")]
    assert parser.feed('ments": {"x"').calls[0].arguments == '{"x"'


def test_markup_split_across_deltas_is_held_until_it_is_known():
    parser = ToolCallParser(HERMES, NAMES)
    assert parser.feed("a <").content == "a"
    assert parser.feed("tool_c").content == ""
    assert parser.feed("ar").content == " <tool_car"  # not the markup after all


def test_what_is_no_call_stays_content_as_vllm_leaves_it():
    for name in ("not JSON", "unknown function", "no calls"):
        assert whole(REPLIES[name]) == (REPLIES[name], [])


def test_an_announced_call_stands_as_far_as_its_json_went():
    assert whole(REPLIES["broken after the name"]) == ("tail", [{"name": "now", "arguments": '{"a": 1'}])
    assert whole(REPLIES["cut in the arguments"]) == ("", [{"name": "get_weather", "arguments": '{"city": "Pa'}])
    assert whole(REPLIES["unclosed"]) == ("", [{"name": "now", "arguments": '{"x": true}'}])


def test_a_call_cut_before_its_name_is_dropped_not_shown_as_text():
    assert whole(REPLIES["cut in the name"]) == ("Sure.", [])
    assert whole(LLAMA_REPLIES["cut in the name"], LLAMA3_JSON) == ("", [])
    assert whole(f"{CALL_NOW}\n{CALL_NOW[:23]}") == ("", [{"name": "now", "arguments": "{}"}])  # ...{"name": "n
    cut_answer = LLAMA_REPLIES["cut in an object that is no call"]
    assert whole(cut_answer, LLAMA3_JSON) == (cut_answer, [])  # names no function: text after all


def test_llama3_calls_start_the_reply_after_an_optional_python_tag():
    assert whole(LLAMA_REPLIES["one call"], LLAMA3_JSON) == (
        "",
        [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}],
    )
    assert whole(LLAMA_REPLIES["python tag, two calls"], LLAMA3_JSON)[1] == [
        {"name": "now", "arguments": "{}"},
        {"name": "now", "arguments": '{"n": 2}'},
    ]
    assert whole(LLAMA_REPLIES["text"], LLAMA3_JSON) == (LLAMA_REPLIES["text"], [])
    assert whole(LLAMA_REPLIES["an object that is no call"], LLAMA3_JSON) == (
        LLAMA_REPLIES["an object that is no call"],
        [],
    )
    assert whole(LLAMA_REPLIES["call then text"], LLAMA3_JSON) == (
        "That is the time.",
        [{"name": "now", "arguments": "{}"}],
    )
    assert whole(CALL_NOW, LLAMA3_JSON) == (CALL_NOW, [])  # Hermes' markup is text to Llama


DOCUMENTS = [
    '{"a": [1, -0.5, 2e10, true, false, null], "b": {"c": "\\n\\u20ac"}}',
    "[]",
    "{}",
    '"just a string"',
    "-12",
    '{"a" 1}',
    '{"a": 01}',
    '{"a": tru}',
    '{"a": [1,]}',
    '{"a": "\\x"}',
    '{"a": 1}}',
    "[1 2]",
    '{"a": "line\nbreak"}',
    '{,"a": 1}',
    "1.",
    "-",
]


def scanned(document: str) -> tuple[bool, str]:
    """Whether the scanner reads `document` as one whole JSON value, and its text as laid out."""
    scanner, text = JsonScanner(), ""
    for position, char in enumerate(document):
        added = scanner.feed(char)
        if added is None:  # whitespace may follow a whole value
            return scanner.done and not document[position:].strip(" \t\n\r"), text
        text += added
    scanner.finish()
    return scanner.done and not scanner.failed, text


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES, indent=st.sampled_from([None, 0, 2]), compact=st.booleans())
def test_json_however_laid_out_scans_into_json_dumps_layout(value, indent, compact):
    separators = (",", ":") if compact else None
    accepted, text = scanned(json.dumps(value, indent=indent, separators=separators))
    assert accepted and text == json.dumps(value)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_scanner_accepts_exactly_what_json_loads_accepts(document):
    try:
        value, valid = json.loads(document), True
    except json.JSONDecodeError:
        valid = False
    accepted, text = scanned(document)
    assert accepted == valid and (not valid or json.loads(text) == value)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(['{', '}', '[', ']', '"a"', '"\\u00e9"', ":", ",", " ", "1", "-", "0", ".5",
                                         "e3", "true", "nul", '"', "\\"]), min_size=1, max_size=14))  # fmt: skip
def test_the_scanner_accepts_what_json_loads_accepts_of_any_fragments(pieces):
    document = "".join(pieces)
    try:
        json.loads(document)
        valid = True
    except json.JSONDecodeError:
        valid = False
    assert scanned(document)[0] == valid
