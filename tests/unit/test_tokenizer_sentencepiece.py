"""SentencePiece GGUF tokenizers (`tokenizer.ggml.model == "llama"`) as the worker rebuilds them, against the
SentencePiece model whose vocabulary the file holds, transformers' reading of the same file, and llguidance's
reading of the tokenizer.json the api gets. Tiny BPE models with byte fallback are trained here
(tests/support/sentencepiece_gguf.py): one numbered like Llama 2's with a space prefix, one like Gemma's without,
its turn markers and space runs user-defined and its space runs spelled with real spaces in the file."""

from __future__ import annotations

import os

import gguf
import pytest
from llguidance import LLTokenizer

from service.api.detokenizer import IncrementalDetokenizer
from service.api.served_model import ServedModel
from service.contract import wire
from tests.support.sentencepiece_gguf import CHAT_TEMPLATE, GEMMA_STYLE, LLAMA_STYLE, write_tokenizer_gguf
from worker.loading.tokenizer import TokenizerInfo, UnsupportedTokenizerError, tokenizer_from_gguf
from worker.sample.grammar import GrammarMatchers

TEXTS = [
    "Hello world!",
    "  two leading spaces and a double  space, trailing  ",
    " one leading space",
    "line one\nline two\n\n\ttabbed",
    "numbers 1234567890 3.14159 -42",
    "héllo wörld, naïve café",
    "中文 and 日本語",
    "emoji 🙂🚀 and a ZWJ family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n",
    "The fisherman was here before the beam of the lighthouse.",
    "",
]
FILES = {  # name -> architecture, SentencePiece options, writer options
    "llama": ("llama", LLAMA_STYLE, {}),
    "gemma": ("gemma3", GEMMA_STYLE, {"spaces_as_spaces": True}),
}


@pytest.fixture(scope="module", params=list(FILES))
def tokenizer_file(request, tmp_path_factory):
    """(the GGUF file's path, its SentencePiece model, the worker's reading of it)"""
    architecture, style, options = FILES[request.param]
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    processor = write_tokenizer_gguf(path, architecture, style, **options)
    return path, processor, tokenizer_from_gguf(read_metadata(path))


def read_metadata(path) -> dict[str, object]:
    return {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}


@pytest.fixture(scope="module")
def transformers_tokenizer(tokenizer_file):
    from transformers import AutoTokenizer

    path = tokenizer_file[0]
    return AutoTokenizer.from_pretrained(os.fspath(path.parent), gguf_file=path.name)


def encode(info: TokenizerInfo, text: str) -> list[int]:
    return info.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_are_sentencepieces_and_decode_back(tokenizer_file, text):
    _, processor, ours = tokenizer_file

    ids = encode(ours, text)

    assert ids == processor.encode(text)
    assert ours.tokenizer.decode(ids) == text == processor.decode(ids)


def test_characters_without_a_piece_fall_back_to_their_bytes(tokenizer_file):
    _, processor, ours = tokenizer_file

    ids = encode(ours, "中")

    assert [processor.IdToPiece(i) for i in ids if processor.IsByte(i)] == ["<0xE4>", "<0xB8>", "<0xAD>"]
    assert processor.unk_id() not in ids


@pytest.mark.parametrize("text", [t for t in TEXTS if not t.startswith(" ")])
def test_token_ids_are_transformers_reading_of_the_same_file(tokenizer_file, transformers_tokenizer, text):
    """transformers reads a Llama file with `Metaspace`, which differs from SentencePiece (and llama.cpp, and us)
    only on a text that starts with a space (tested above against SentencePiece)."""
    ids = encode(tokenizer_file[2], text)

    assert ids == transformers_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer_file[2].tokenizer.decode(ids) == transformers_tokenizer.decode(ids)


def test_special_tokens_stay_whole_and_decode_away(tokenizer_file, transformers_tokenizer):
    """(transformers' `Metaspace` puts no space in front of the text after a special token: compared without one.)"""
    path, processor, ours = tokenizer_file
    bos, eos = processor.IdToPiece(processor.bos_id()), processor.IdToPiece(processor.eos_id())
    text = f"{bos}Hello world{eos}"

    ids = encode(ours, text)

    assert ids[0] == processor.bos_id() and ids[-1] == processor.eos_id()
    if not read_metadata(path)["tokenizer.ggml.add_space_prefix"]:
        assert ids == transformers_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ours.tokenizer.decode(ids) == "Hello world"


def test_the_text_after_a_special_token_gets_the_space_prefix_as_in_llama_cpp(tokenizer_file):
    """llama.cpp's SentencePiece tokenizer puts a space in front of each text that follows a special token."""
    _, processor, ours = tokenizer_file
    bos = processor.IdToPiece(processor.bos_id())

    ids = encode(ours, f"{bos}Hello world")

    assert ids == [processor.bos_id(), *processor.encode("Hello world")]


def test_gemmas_turn_markers_are_one_token_each(tmp_path):
    path = tmp_path / "gemma.gguf"
    processor = write_tokenizer_gguf(path, "gemma3", GEMMA_STYLE, spaces_as_spaces=True)
    ours = tokenizer_from_gguf(read_metadata(path))
    text = "<start_of_turn>user\nHello   world<end_of_turn>\n"

    ids = encode(ours, text)

    assert ids == processor.encode(text)
    assert ids[0] == processor.PieceToId("<start_of_turn>") and "\u2581\u2581\u2581" in map(processor.IdToPiece, ids)
    assert ids[-2] == processor.PieceToId("<end_of_turn>")


def test_a_run_of_more_spaces_than_gemmas_longest_space_token_splits_as_in_sentencepiece(tmp_path):
    """Gemma's runs of 2 to 31 spaces are user-defined: matched whole, longest first, as SentencePiece and llama.cpp
    match them; 40 spaces are 31 and 9."""
    path = tmp_path / "gemma.gguf"
    processor = write_tokenizer_gguf(path, "gemma3", GEMMA_STYLE, spaces_as_spaces=True)
    ours = tokenizer_from_gguf(read_metadata(path))

    for text in ["a" + " " * 40 + "b", " " * 31, " " * 63 + "\n"]:
        assert encode(ours, text) == processor.encode(text)
        assert ours.tokenizer.decode(encode(ours, text)) == text


@pytest.mark.parametrize("space_runs_user_defined", [True, False])
def test_gemmas_runs_of_spaces_spelled_with_spaces_are_its_space_tokens(tmp_path, space_runs_user_defined):
    """The file spells them "  ", the vocabulary `▁▁`: typed user-defined or normal, they are the tokens a run of
    spaces takes."""
    path = tmp_path / "gemma.gguf"
    processor = write_tokenizer_gguf(
        path, "gemma3", GEMMA_STYLE, spaces_as_spaces=True, space_runs_user_defined=space_runs_user_defined
    )
    ours = tokenizer_from_gguf(read_metadata(path))

    for text in ["a" + " " * 31 + "b", "x  y   z    w", " " * 17 + "\n"]:
        assert encode(ours, text) == processor.encode(text)
        assert ours.tokenizer.decode(encode(ours, text)) == text


def test_gemmas_merges_follow_the_order_of_its_tokens_not_their_scores(tmp_path):
    path = tmp_path / "gemma.gguf"
    processor = write_tokenizer_gguf(path, "gemma3", GEMMA_STYLE, spaces_as_spaces=True, scores=False)
    ours = tokenizer_from_gguf(read_metadata(path))

    for text in TEXTS:
        assert encode(ours, text) == processor.encode(text)


@pytest.mark.parametrize("output", [" The fish 中文 🙂 was\n\n  here.", "Hello world", "中文 first"])
def test_output_tokens_stream_to_their_text_one_at_a_time(tokenizer_file, output):
    """The api's detokenizer, on a decoder that drops the space in front: the first output token keeps its space."""
    ours = tokenizer_file[2]
    prompt = "Question: where?"
    prompt_ids = [ours.bos_token_id, *encode(ours, prompt)]
    all_ids = [ours.bos_token_id, *encode(ours, prompt + output)]
    assert all_ids[: len(prompt_ids)] == prompt_ids

    detokenizer = IncrementalDetokenizer(ours.tokenizer, prompt_ids)
    streamed = "".join(detokenizer.add([token_id]) for token_id in all_ids[len(prompt_ids) :]) + detokenizer.flush()

    assert streamed == output


def test_special_ids_and_template_come_from_the_file(tokenizer_file):
    _, processor, ours = tokenizer_file

    assert ours.bos_token_id == processor.bos_id()
    assert ours.eos_token_ids == [processor.eos_id()]
    assert ours.add_bos_token is True
    assert ours.chat_template == CHAT_TEMPLATE


def test_a_file_that_does_not_say_adds_bos_as_llama_cpp_does(tokenizer_file):
    metadata = read_metadata(tokenizer_file[0])
    del metadata["tokenizer.ggml.add_bos_token"]

    assert tokenizer_from_gguf(metadata).add_bos_token is True


def test_an_unknown_tokenizer_model_is_still_refused(tokenizer_file):
    metadata = dict(read_metadata(tokenizer_file[0]), **{"tokenizer.ggml.model": "rwkv"})

    with pytest.raises(UnsupportedTokenizerError, match="rwkv"):
        tokenizer_from_gguf(metadata)


def model_info(ours: TokenizerInfo) -> wire.ModelInfo:
    """What the worker tells the api and its grammars of a model with this tokenizer."""
    return wire.ModelInfo(
        name="tiny",
        max_model_len=64,
        vocab_size=ours.tokenizer.get_vocab_size(),
        eos_token_ids=ours.eos_token_ids,
        bos_token_id=ours.bos_token_id,
        tokenizer_json=ours.tokenizer.to_str(),
        chat_template=ours.chat_template,
        add_bos_token=ours.add_bos_token,
    )


def test_llguidance_reads_the_tokenizer_json_and_spells_every_token_as_we_decode_it(tokenizer_file):
    _, processor, ours = tokenizer_file
    info = model_info(ours)
    assert GrammarMatchers(info).problem is None

    ll = LLTokenizer(info.tokenizer_json, n_vocab=info.vocab_size, eos_token=info.eos_token_ids)
    for token_id in range(info.vocab_size):
        if processor.IsControl(token_id) or processor.IsUnknown(token_id) or processor.IdToPiece(token_id) == "<0xFF>":
            continue  # 0xFF is in no UTF-8 text: llguidance's token trie marks special tokens with it
        piece = processor.IdToPiece(token_id)
        expected = bytes([int(piece[3:5], 16)]) if processor.IsByte(token_id) else piece.replace("\u2581", " ").encode()
        assert ll.decode_bytes([token_id]) == expected, piece


def test_logprobs_name_each_token_by_its_own_piece_space_and_bytes_kept(tokenizer_file):
    """The api's ServedModel: a lone token keeps the space its piece spells (the decoder drops a text's first
    space), a byte token is its byte, a special token its name; together a text's tokens are the text's bytes."""
    _, processor, ours = tokenizer_file
    served = ServedModel(model_info(ours))
    text = "The fish 中文 was here"
    token_ids = encode(ours, text)
    assert b"".join(
        bytes(served.token_bytes(t)) for t in token_ids
    ).decode() == ours.tokenizer.normalizer.normalize_str(text).replace("\u2581", " ")
    byte_token = processor.piece_to_id("<0xE4>")
    assert served.token_bytes(byte_token) == [0xE4] and served.token_text(byte_token) == "\ufffd"
    spaced = next(
        t for t in token_ids if processor.id_to_piece(t).startswith("\u2581") and len(processor.id_to_piece(t)) > 1
    )
    assert served.token_text(spaced) == " " + processor.id_to_piece(spaced)[1:]
    assert served.token_text(ours.bos_token_id) == processor.id_to_piece(ours.bos_token_id)
