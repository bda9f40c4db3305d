"""Token ids to text, a few at a time, without splitting a character.

vLLM's prefix/read-offset method: decode a short window of recent tokens twice, once up to
what was already emitted and once up to now, and emit the difference. A window that ends in
the middle of a UTF-8 character decodes to a trailing U+FFFD; then nothing is emitted until a
later token completes the character. The window starts in the prompt so that a tokenizer whose
decoding depends on the previous token (a leading space) gets it right on the first token.
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The text of one sequence's output tokens, emitted as soon as it is whole."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = len(self._token_ids)  # tokens before this are already emitted

    def add(self, token_ids: list[int]) -> str:
        """Text completed by these tokens; "" while a character is still unfinished."""
        self._token_ids.extend(token_ids)
        prefix_text, full_text = self._window_texts()
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._advance()
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end of the sequence, even an unfinished character."""
        prefix_text, full_text = self._window_texts()
        self._advance()
        return full_text[len(prefix_text) :]

    def _window_texts(self) -> tuple[str, str]:
        window = self._token_ids[self._prefix_offset :]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset])
        return prefix_text, self._decode(window)

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)
