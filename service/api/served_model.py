"""The model as the api sees it: built from the scheduler's ModelInfo, no model files needed.

Tokenizes prompts, renders chats, names tokens for logprobs, and checks requests against the
model's limits.
"""

from __future__ import annotations

import functools
import re

from tokenizers import Tokenizer, decoders, models

from service.api.chat_template import ChatTemplateError, render_chat
from service.api.errors import ApiError
from service.api.tools import format_for, template_renders_tools, with_tool_preamble
from service.contract.wire import ModelInfo

SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte without a piece of its own


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-printable-character map, inverted: which byte each character stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_of_byte = {byte: chr(byte) for byte in printable}
    for extra, byte in enumerate(byte for byte in range(256) if byte not in char_of_byte):
        char_of_byte[byte] = chr(256 + extra)
    return {char: byte for byte, char in char_of_byte.items()}


class ServedModel:
    """Tokenizer, chat template and limits of the model the scheduler serves."""

    def __init__(self, info: ModelInfo, tool_call_parser: str = "auto") -> None:
        self.info = info
        self.tool_format = format_for(tool_call_parser, info.chat_template)  # how its replies write tool calls
        self.name = info.name
        self.max_model_len = info.max_model_len
        self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self._byte_level = isinstance(self.tokenizer.decoder, decoders.ByteLevel)
        # A SentencePiece vocabulary (worker/loading/sentencepiece_bpe.py): pieces spell spaces "▁" and bytes
        # without a piece "<0xNN>"; its decoder drops a text's first space, which a lone token must keep.
        self._sentencepiece = isinstance(self.tokenizer.model, models.BPE) and bool(self.tokenizer.model.byte_fallback)
        self._special_ids = {i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special}
        self._token_texts: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt text, with the BOS token when the model wants one."""
        # encode_batch releases the GIL (encode does not), so a long text does not stall the event loop.
        token_ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.info.bos_token_id
        if self.info.add_bos_token and bos is not None and token_ids[:1] != [bos]:
            return [bos, *token_ids]  # unless the text (a rendered chat template) already starts with it
        return token_ids

    def encode_chat(self, messages: list[dict[str, object]], tools: list[dict] | None = None) -> list[int]:
        """The prompt of a chat; `tools` rendered by the template, or else described in a system preamble."""
        if not self.info.chat_template:
            raise ApiError(400, "This model has no chat template; use /v1/completions.", param="messages")
        if tools and not template_renders_tools(self.info.chat_template):
            messages, tools = with_tool_preamble(messages, tools, self.tool_format), None
        try:
            text = render_chat(
                self.info.chat_template,
                messages,
                tools=tools,
                bos_token=self._special_token(self.info.bos_token_id),
                eos_token=self._special_token(self.info.eos_token_ids[0] if self.info.eos_token_ids else None),
            )
        except ChatTemplateError as exc:
            param = "messages" if exc.message_index is None else f"messages.{exc.message_index}"
            raise ApiError(400, f"This chat cannot be rendered: {exc}.", param=param) from None
        return self.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode_batch([token_ids], skip_special_tokens=True)[0]  # releases the GIL

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (special tokens included), for logprobs."""
        text = self._token_texts.get(token_id)
        if text is None:
            piece_bytes = self._piece_bytes(token_id)
            if piece_bytes is not None:
                text = bytes(piece_bytes).decode("utf-8", errors="replace")
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The exact bytes of a token, even one that holds part of a character."""
        if self._byte_level:
            alphabet = byte_level_alphabet()
            piece = self.tokenizer.id_to_token(token_id) or ""
            if piece and all(char in alphabet for char in piece):
                return [alphabet[char] for char in piece]
        piece_bytes = self._piece_bytes(token_id)
        return piece_bytes if piece_bytes is not None else list(self.token_text(token_id).encode("utf-8"))

    def _piece_bytes(self, token_id: int) -> list[int] | None:
        """A SentencePiece token's bytes as its piece spells them (its space kept), or None (another vocabulary, a
        special token)."""
        if not self._sentencepiece or token_id in self._special_ids:
            return None
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        if byte := SENTENCEPIECE_BYTE.fullmatch(piece):
            return [int(byte.group(1), 16)]
        return list(piece.replace("\u2581", " ").encode("utf-8"))

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.info.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise ApiError(400, f"Token id {token_id} is out of vocabulary (size {vocab_size}).", param=param)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """max_tokens, or what is left of the context if None; 400 if the request cannot fit."""
        if num_prompt_tokens == 0:
            raise ApiError(400, "The prompt is empty.", param="prompt")
        limit = self.max_model_len
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, your messages "
                    f"resulted in {num_prompt_tokens} tokens. Please reduce the length of the messages.",
                    param="messages",
                    code="context_length_exceeded",
                )
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in "
                "the completion). Please reduce the length of the prompt or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def check_name(self, requested: str | None) -> None:
        if requested and requested != self.name and requested not in self.info.aliases:
            raise ApiError(
                404,
                f"The model `{requested}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )

    def _special_token(self, token_id: int | None) -> str:
        return "" if token_id is None else self.token_text(token_id)
