"""One JSON value read a character at a time, as a model writes it: whether each character keeps it valid JSON, and
its text with the whitespace between tokens laid out as `json.dumps` lays it (`", "`, `": "`, nothing else).

A streamed tool call's arguments go out as this text, fragment by fragment, so the fragments join into exactly the
arguments of the whole reply; strings, escapes and numbers are kept as written. A parser of partial JSON into objects
(partial-json-parser, which vLLM uses) would need the fragments recovered by diffing re-serialisations of growing
objects, holding back unfinished strings and numbers; reading characters needs neither.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
NUMBER_CHARS = frozenset("0123456789+-.eE")
LITERALS = {"t": "true", "f": "false", "n": "null"}
ESCAPES = frozenset('"\\/bfnrtu')
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
WHITESPACE = frozenset(" \t\n\r")

# What the next token may be.
VALUE, VALUE_OR_CLOSE, KEY, KEY_OR_CLOSE, COLON, COMMA_OR_CLOSE = range(6)


class JsonScanner:
    """One JSON value; `feed` each character. `done` once the value is whole, `failed` once it cannot be."""

    def __init__(self) -> None:
        self.done = False
        self.failed = False
        self._containers: list[str] = []  # "{" or "[" of each open object or array
        self._expect = VALUE
        self._in_string = False
        self._string_is_key = False
        self._hex_left = 0  # hex digits still due in a \\u escape
        self._after_backslash = False
        self._word = ""  # a number or literal being written

    def feed(self, char: str) -> str | None:
        """The text `char` adds to the value ("" for whitespace between tokens); None if the value ended before it
        (`char` is not part of it) or can no longer be JSON (then `failed` is set)."""
        if self.done or self.failed:
            return None
        if self._in_string:
            return self._string_char(char)
        if self._word:
            if self._word_continues(char):
                self._word += char
                if self._word == LITERALS.get(self._word[0]):
                    self._word = ""
                    self._value_ended()
                return char
            if not self._word_ended():
                return None
            if self.done:
                return None
        if char in WHITESPACE:
            return ""
        return self._token(char)

    def finish(self) -> None:
        """The text has ended: a number at the top level is whole now."""
        if self._word and not self._containers and self._word_ended():
            self.done = True

    def _token(self, char: str) -> str | None:
        expect = self._expect
        if expect in (VALUE, VALUE_OR_CLOSE):
            if char == "]" and expect == VALUE_OR_CLOSE:
                return self._close(char)
            if char in "{[":
                self._containers.append(char)
                self._expect = KEY_OR_CLOSE if char == "{" else VALUE_OR_CLOSE
                return char
            if char == '"':
                self._in_string, self._string_is_key = True, False
                return char
            if char in "-0123456789" or char in LITERALS:
                self._word = char
                return char
        elif expect in (KEY, KEY_OR_CLOSE):
            if char == "}" and expect == KEY_OR_CLOSE:
                return self._close(char)
            if char == '"':
                self._in_string, self._string_is_key = True, True
                return char
        elif expect == COLON:
            if char == ":":
                self._expect = VALUE
                return ": "
        elif char == ",":
            self._expect = KEY if self._containers[-1] == "{" else VALUE
            return ", "
        elif char == {"{": "}", "[": "]"}[self._containers[-1]]:
            return self._close(char)
        return self._fail()

    def _string_char(self, char: str) -> str | None:
        if self._hex_left:
            if char not in HEX_DIGITS:
                return self._fail()
            self._hex_left -= 1
        elif self._after_backslash:
            if char not in ESCAPES:
                return self._fail()
            self._after_backslash = False
            self._hex_left = 4 if char == "u" else 0
        elif char == "\\":
            self._after_backslash = True
        elif char == '"':
            self._in_string = False
            if self._string_is_key:
                self._expect = COLON
            else:
                self._value_ended()
        elif ord(char) < 0x20:  # control characters must be escaped
            return self._fail()
        return char

    def _word_continues(self, char: str) -> bool:
        literal = LITERALS.get(self._word[0])
        if literal is not None:
            return literal.startswith(self._word + char)
        return char in NUMBER_CHARS

    def _word_ended(self) -> bool:
        """A number ends at the first character that cannot continue it; False (and failed) if it is no number."""
        if self._word[0] in LITERALS or not NUMBER.fullmatch(self._word):
            self._fail()
            return False
        self._word = ""
        self._value_ended()
        return True

    def _close(self, char: str) -> str:
        self._containers.pop()
        self._value_ended()
        return char

    def _value_ended(self) -> None:
        if self._containers:
            self._expect = COMMA_OR_CLOSE
        else:
            self.done = True

    def _fail(self) -> None:
        self.failed = True
        return None
