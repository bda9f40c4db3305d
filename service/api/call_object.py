"""One tool call's JSON object, {"name": ..., "arguments": {...}}, read a character at a time as a model writes it."""

from __future__ import annotations

import json

from service.api.json_scanner import WHITESPACE, JsonScanner

# Where a call's object is.
OPEN, KEY_OR_CLOSE, KEY, COLON, VALUE, COMMA_OR_CLOSE, DONE = range(7)


class CallObject:
    """One call's JSON object, {"name": ..., "arguments": {...}}, a character at a time: its name once read, and the
    text of its arguments as it comes. Other keys are read and ignored; the first arguments key counts."""

    def __init__(self, arguments_keys: tuple[str, ...]) -> None:
        self._arguments_keys = arguments_keys
        self.name: str | None = None
        self.has_arguments = False
        self.reads_a_name = False  # a "name" key has been read: the object is a call, unless its value shows otherwise
        self.failed = False
        self._where = OPEN
        self._key = ""
        self._value: JsonScanner | None = None  # the key or value being read
        self._value_text = ""
        self._value_is_arguments = False

    @property
    def done(self) -> bool:
        return self._where == DONE

    def feed(self, char: str) -> str:
        """The arguments text `char` adds ("" if none); sets `name`, `done` or `failed` as they become true."""
        if self.failed or self.done:
            self.failed = True
            return ""
        if self._value is not None:
            added = self._value.feed(char)
            if self._value.failed:
                self.failed = True
                return ""
            if added is not None:
                self._value_text += added
                if self._value.done:
                    self._value_ended()
                return added if self._value_is_arguments else ""
            self._value_ended()  # a number, ended by this character
        if char in WHITESPACE:
            return ""
        where = self._where
        if where == OPEN and char == "{":
            self._where = KEY_OR_CLOSE
        elif where in (KEY, KEY_OR_CLOSE) and char == '"':
            self._read_value(is_arguments=False)
            return self.feed(char)
        elif where in (KEY_OR_CLOSE, COMMA_OR_CLOSE) and char == "}":
            self._where = DONE
        elif where == COLON and char == ":":
            self._where = VALUE
        elif where == COMMA_OR_CLOSE and char == ",":
            self._where = KEY
        elif where == VALUE and (self._key != "name" or char == '"'):
            is_arguments = self._key in self._arguments_keys and not self.has_arguments
            self.has_arguments |= is_arguments
            self._read_value(is_arguments)
            return self.feed(char)
        else:
            self.failed = True
        return ""

    def _read_value(self, is_arguments: bool) -> None:
        self._value, self._value_text, self._value_is_arguments = JsonScanner(), "", is_arguments

    def _value_ended(self) -> None:
        text, self._value = self._value_text, None
        if self._where in (KEY, KEY_OR_CLOSE):
            self._key, self._where = json.loads(text), COLON
            self.reads_a_name |= self._key == "name"
            return
        if self._key == "name" and self.name is None:
            self.name = json.loads(text)
        self._where = COMMA_OR_CLOSE
