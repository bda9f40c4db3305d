from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.support.tiny_model import tiny_tokenizer


def stream_text(text: str, prompt: str = "") -> list[str]:
    """What the detokenizer emits when the tokens of `text` arrive one at a time, then the flush."""
    tokenizer = tiny_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt, add_special_tokens=False).ids)
    pieces = [detokenizer.add([token_id]) for token_id in tokenizer.encode(text, add_special_tokens=False).ids]
    return [*pieces, detokenizer.flush()]


def test_characters_split_across_tokens_are_emitted_whole_once_complete():
    text = "naïve 日本語 🙂🚀 ok"
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert any(tokenizer.decode([token_id]).count(REPLACEMENT_CHAR) for token_id in token_ids), "test needs split chars"

    pieces = stream_text(text)

    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    assert "".join(pieces) == text
    assert "" in pieces[:-1]  # something was held back while a character was incomplete


def test_output_after_a_prompt_does_not_repeat_the_prompt():
    assert "".join(stream_text(" world", prompt="Hello")) == " world"


def test_special_tokens_produce_no_text():
    tokenizer = tiny_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    end_of_turn = tokenizer.token_to_id("<|im_end|>")
    assert detokenizer.add(tokenizer.encode("Hi", add_special_tokens=False).ids) == "Hi"
    assert detokenizer.add([end_of_turn]) == ""
    assert detokenizer.flush() == ""


def test_an_unfinished_character_at_the_end_is_flushed_as_a_replacement():
    tokenizer = tiny_tokenizer()
    first_byte_of_rocket = tokenizer.encode("🚀", add_special_tokens=False).ids[0]
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.add([first_byte_of_rocket]) == ""
    assert detokenizer.flush().startswith(REPLACEMENT_CHAR)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT_CHAR), max_size=40))
def test_streamed_text_equals_the_whole_decode_and_never_shows_a_replacement(text):
    pieces = stream_text(text)
    assert "".join(pieces) == tiny_tokenizer().decode(tiny_tokenizer().encode(text, add_special_tokens=False).ids)
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
