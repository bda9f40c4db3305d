"""Tokenizers: rebuilt from GGUF metadata (byte-level BPE, SentencePiece BPE) or read from a folder's tokenizer.json.

No Paddle here: the api may import this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from worker.loading.sentencepiece_bpe import SPACE, gguf_pieces, sentencepiece_bpe

GGUF_UNKNOWN_TOKEN = 2
GGUF_CONTROL_TOKEN = 3
GGUF_USER_DEFINED_TOKEN = 4


class UnsupportedTokenizerError(ValueError):
    """The model files describe a tokenizer this worker cannot rebuild."""


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer and the special-token facts a server needs beside it."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int]) -> Tokenizer:
    """The tokenizer transformers builds for a GGUF with `tokenizer.ggml.model == "gpt2"`."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ")) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels; transformers skips them too.
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == GGUF_CONTROL_TOKEN and set(token) <= alphabet
    ]
    tokenizer.add_special_tokens(special)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == GGUF_USER_DEFINED_TOKEN and token in vocab
    ]
    tokenizer.add_tokens(user_defined)
    return tokenizer


def sentencepiece_tokenizer(metadata: dict[str, object]) -> Tokenizer:
    """The tokenizer llama.cpp and transformers read from a GGUF with `tokenizer.ggml.model == "llama"`."""
    tokens = metadata["tokenizer.ggml.tokens"]
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = sentencepiece_bpe(
        tokens,
        metadata.get("tokenizer.ggml.scores"),
        add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
        unknown_token=None if unknown is None else tokens[int(unknown)],
        architecture=metadata.get("general.architecture"),
    )
    # llama.cpp matches control, unknown and user-defined tokens whole in a text; the first two are special.
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind in (GGUF_CONTROL_TOKEN, GGUF_UNKNOWN_TOKEN)
    ]
    tokenizer.add_special_tokens(special)
    # A token the file spells with spaces and the tokenizer with ▁ (Gemma's runs of spaces) is matched in the text
    # as normalized, where spaces are ▁.
    pieces = gguf_pieces(tokens, metadata.get("general.architecture"))
    user_defined = [
        AddedToken(piece, normalized=piece != token and set(piece) == {SPACE}, special=False)
        for piece, token, kind in zip(pieces, tokens, token_types)
        if kind == GGUF_USER_DEFINED_TOKEN
    ]
    tokenizer.add_tokens(user_defined)
    return tokenizer


def tokenizer_from_gguf(metadata: dict[str, object]) -> TokenizerInfo:
    """Read the `tokenizer.*` keys of a GGUF file."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = byte_level_bpe(
            metadata["tokenizer.ggml.tokens"],
            metadata.get("tokenizer.ggml.merges", []),
            metadata.get("tokenizer.ggml.token_type", []),
        )
    elif kind == "llama":
        tokenizer = sentencepiece_tokenizer(metadata)
    else:
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer {kind!r} is not supported (only byte-level BPE 'gpt2' and SentencePiece 'llama')"
        )
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return TokenizerInfo(
        tokenizer=tokenizer,
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_unique(int(metadata[key]) for key in eos_keys if key in metadata),
        add_bos_token=bool(add_bos),
    )


def tokenizer_from_folder(folder: Path, model_config: dict) -> TokenizerInfo:
    """Read tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    generation_config = _read_json(folder / "generation_config.json")

    def token_id(name: str) -> int | None:
        token = tokenizer_config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        return tokenizer.token_to_id(token) if isinstance(token, str) else None

    eos_ids = [token_id("eos_token")]
    for source in (generation_config, model_config):
        value = source.get("eos_token_id")
        eos_ids.extend(value if isinstance(value, list) else [value])
    bos = token_id("bos_token")
    return TokenizerInfo(
        tokenizer=tokenizer,
        chat_template=_chat_template(folder, tokenizer_config),
        bos_token_id=bos if bos is not None else model_config.get("bos_token_id"),
        eos_token_ids=_unique(int(eos) for eos in eos_ids if eos is not None),
        add_bos_token=bool(tokenizer_config.get("add_bos_token", False)),
    )


def _chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: serve the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _unique(values) -> list[int]:
    return list(dict.fromkeys(values))
