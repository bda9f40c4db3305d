"""A reply's tool calls read as it streams, in the format its model family writes them (`ToolFormat`).

Text outside calls streams as content. From where a call may begin its text is held; once the call's name is read,
and is a listed function's, the call is announced (index, id, name) and its arguments go out as the model writes
them, their whitespace laid out as `json.dumps` lays it. A whole reply is read by the same parser, so a streamed
reply's deltas join into the calls and content of the same reply unstreamed.

What is not a call stays content, as vLLM's parsers leave a reply they cannot parse: held text whose JSON breaks
before the name is known, or that names no listed function, goes out as content. A reply that ends (max_tokens)
inside a call before its name is read drops that call's text, as vLLM's streaming parsers never send it. A call
already announced stands (vLLM's streaming parsers do the same): if its JSON breaks, its arguments are what was valid
so far, and the rest of the call is dropped; if the reply is cut (max_tokens), so are its arguments, and
finish_reason says `length`. Whitespace before a call is dropped, and so is whitespace a call leaves at the start or
the end of the content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from service.api.call_object import CallObject
from service.api.json_scanner import WHITESPACE


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls."""

    name: str  # BLOCKSERVE_TOOL_CALL_PARSER's value
    open: str  # the markup before a call
    close: str  # the markup after a call ("" if none)
    separator: str  # between calls, in the grammars of calls
    arguments_keys: tuple[str, ...]  # the key of the arguments in a call's object, first the one the grammar writes
    calls_follow_text: bool  # False: a reply with calls is calls from its start, and `open` is optional there
    preamble: str  # asks for this format, for a chat template that does not render tools

    def call_body_keys(self) -> tuple[str, str]:
        return "name", self.arguments_keys[0]


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass
class CallDelta:
    """New output of one call: its first carries the id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_arguments(self, index: int, text: str) -> None:
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += text
        else:
            self.calls.append(CallDelta(index, text))


# What the parser is reading.
START, TEXT, PLAIN, CALL, AFTER_CALL = range(5)


class ToolCallParser:
    """One choice's reply: `feed` its text as it comes, then `finish`; each returns what can go out now."""

    def __init__(self, tool_format: ToolFormat, tool_names: set[str]) -> None:
        self._format = tool_format
        self._tool_names = tool_names
        self._reading = TEXT if tool_format.calls_follow_text else START
        self._held = ""  # text not given out yet: markup that may be beginning, whitespace that may border a call
        self._skip_space = False  # right after a call, before any content: whitespace is dropped
        self._shown_content = False
        self._call: CallObject | None = None
        self._call_text = ""  # the call's text so far, given out as content if it is no call after all
        self._call_index: int | None = None  # set once the call is announced
        self._early_arguments = ""  # arguments written before the name
        self.num_calls = 0
        self._out = ParsedDelta()

    def feed(self, text: str) -> ParsedDelta:
        for char in text:
            self._char(char)
        out, self._out = self._out, ParsedDelta()
        return out

    def finish(self) -> ParsedDelta:
        """What was held, at the end of the reply."""
        if self._reading == CALL and self._call_index is None:
            if self._format.open in self._call_text or self._call.reads_a_name or self.num_calls:
                self._call_text = ""  # a call cut before its name was read: markup, not text
            self._not_a_call()
            self._reading = TEXT if self._format.calls_follow_text else PLAIN
        if self._reading in (START, TEXT):
            self._show(self._held.rstrip() if self.num_calls else self._held)
        self._held = ""
        out, self._out = self._out, ParsedDelta()
        return out

    def _show(self, text: str) -> None:
        self._out.content += text
        self._shown_content |= bool(text)

    def _char(self, char: str) -> None:
        reading = self._reading
        if reading == PLAIN:
            self._show(char)
        elif reading == TEXT:
            self._text_char(char)
        elif reading == START:
            self._start_char(char)
        elif reading == CALL:
            self._call_char(char)
        else:
            self._after_call_char(char)

    def _text_char(self, char: str) -> None:
        if self._skip_space:
            if char in WHITESPACE:
                return
            self._skip_space = False
        held = self._held + char
        opening = self._format.open
        if held.endswith(opening):
            self._held = ""
            self._start_call(opening)
            return
        keep = next((n for n in range(len(opening) - 1, 0, -1) if held.endswith(opening[:n])), 0)
        text, markup = held[: len(held) - keep], held[len(held) - keep :]
        shown = text.rstrip()
        self._show(shown)
        self._held = text[len(shown) :] + markup

    def _start_char(self, char: str) -> None:
        """The reply's first characters, where a format whose calls start the reply may open one."""
        self._held += char
        begun = self._held.lstrip()
        if not begun or (self._format.open.startswith(begun) and begun != self._format.open):
            return
        held, self._held = self._held, ""
        if begun == self._format.open:
            self._start_call(held)
        elif begun == "{":
            self._start_call(held[:-1])
            self._call_char("{")
        else:
            self._reading = PLAIN
            self._show(held)

    def _start_call(self, markup: str) -> None:
        self._reading = CALL
        self._call = CallObject(self._format.arguments_keys)
        self._call_text, self._call_index, self._early_arguments = markup, None, ""

    def _call_char(self, char: str) -> None:
        call = self._call
        self._call_text += char
        arguments = call.feed(char)
        if call.failed:
            self._call_text = self._call_text[:-1]
            self._call_failed()
            self._char(char)  # read again as what follows the call
            return
        if call.name is not None and self._call_index is None:
            if call.name not in self._tool_names:
                self._not_a_call()
                self._reading = TEXT if self._format.calls_follow_text else PLAIN
                return
            self._announce(call.name)
        if self._call_index is None:
            self._early_arguments += arguments
        elif arguments:
            self._out.add_arguments(self._call_index, arguments)
        if call.done:
            if self._call_index is None:  # an object without a name
                self._call_failed()
                return
            if not call.has_arguments:
                self._out.add_arguments(self._call_index, "{}")
            self._reading, self._held = AFTER_CALL, ""

    def _announce(self, name: str) -> None:
        self._call_index, self.num_calls = self.num_calls, self.num_calls + 1
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self._out.calls.append(CallDelta(self._call_index, self._early_arguments, call_id, name))

    def _call_failed(self) -> None:
        if self._call_index is None:
            self._not_a_call()
            self._reading = TEXT if self._format.calls_follow_text else PLAIN
        else:  # announced: it stands as far as it went
            self._reading, self._held = AFTER_CALL, ""

    def _not_a_call(self) -> None:
        self._show(self._call_text)
        self._call_text = ""

    def _after_call_char(self, char: str) -> None:
        """Between a call's object and what follows: its closing markup, the next call, or text."""
        tool_format = self._format
        if not tool_format.close:  # calls separated by `separator`'s punctuation, or text
            if char in WHITESPACE:
                return
            if char == tool_format.separator.strip():
                self._start_call("")
            else:
                self._reading = PLAIN
                self._show(char)
            return
        self._held += char
        if self._held.endswith(tool_format.close):
            self._reading, self._held, self._skip_space = TEXT, "", not self._shown_content
        elif self._held.endswith(tool_format.open):
            self._held = ""
            self._start_call(tool_format.open)
        else:
            longest = max(len(tool_format.close), len(tool_format.open))
            self._held = self._held[-longest:]  # what is dropped can no longer end in either


def parse_reply(text: str, tool_format: ToolFormat, tool_names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """A whole reply's content (None if it has calls and no other text) and its calls, read as a stream is read."""
    parser = ToolCallParser(tool_format, tool_names)
    deltas = [parser.feed(text), parser.finish()]
    content = "".join(delta.content for delta in deltas)
    calls: dict[int, ParsedCall] = {}
    for delta in deltas:
        for piece in delta.calls:
            if piece.index in calls:
                before = calls[piece.index]
                calls[piece.index] = ParsedCall(before.id, before.name, before.arguments + piece.arguments)
            else:
                calls[piece.index] = ParsedCall(piece.id, piece.name, piece.arguments)
    return (content or None) if calls else content, [calls[index] for index in sorted(calls)]
