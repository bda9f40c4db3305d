from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.stop import StopMatcher


def feed_all(stop_strings: list[str], chunks: list[str]) -> tuple[list[str], str | None]:
    matcher = StopMatcher(stop_strings)
    emitted = [matcher.feed(chunk) for chunk in chunks]
    return [*emitted, matcher.flush()], matcher.matched


def test_text_that_may_start_a_stop_string_is_held_back_until_decided():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("Hello </e") == "Hello "
    assert matcher.feed("n") == ""
    assert matcher.feed("d> and more") == ""
    assert matcher.matched == "</end>"
    assert matcher.flush() == ""


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop_string():
    emitted, matched = feed_all(["lo there"], ["Hel", "lo", " world"])
    assert emitted == ["He", "l", "lo world", ""]  # "l", then "lo", waited for the next text
    assert matched is None


def test_a_stop_string_split_across_chunks_cuts_before_it():
    emitted, matched = feed_all(["lo w"], ["He", "llo", " world"])
    assert "".join(emitted) == "Hel"
    assert matched == "lo w"


def test_the_stop_string_that_completes_first_wins():
    emitted, matched = feed_all(["ello w", "o"], ["Hello world"])
    assert "".join(emitted) == "Hell"
    assert matched == "o"


def test_without_stop_strings_everything_passes_at_once():
    assert StopMatcher([]).feed("anything") == "anything"


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stop_strings=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_output_is_the_text_before_the_first_completed_stop_string_however_it_is_chunked(text, stop_strings, cuts):
    bounds = sorted({0, len(text), *(min(cut, len(text)) for cut in cuts)})
    chunks = [text[start:end] for start, end in zip(bounds, bounds[1:])]
    matches = [(text.find(stop) + len(stop), text.find(stop)) for stop in stop_strings if stop in text]
    expected = text[: min(matches)[1]] if matches else text

    emitted, matched = feed_all(stop_strings, chunks)

    assert "".join(emitted) == expected
    assert (matched is not None) == bool(matches)
