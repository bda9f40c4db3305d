import re

import pytest

from service.api.openapi import bounded_by_vocabulary, decimal_at_most
from service.api.protocol import TOKEN_ID_MARK


@pytest.mark.parametrize("maximum", [0, 1, 7, 9, 10, 11, 19, 20, 99, 100, 101, 109, 110, 999, 1000, 12345, 49151])
def test_the_token_id_pattern_matches_exactly_the_numbers_up_to_the_maximum(maximum):
    pattern = re.compile(decimal_at_most(maximum))
    assert [n for n in range(2 * maximum + 100) if pattern.fullmatch(str(n))] == list(range(maximum + 1))
    assert not any(pattern.fullmatch(text) for text in ("", "00", "01", "-1", "+1", "1.0", " 1", "a"))


def test_the_document_bounds_every_marked_token_id_and_nothing_else():
    document = {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, TOKEN_ID_MARK: True}},
        "bias": {"propertyNames": {"type": "string", "pattern": "^[0-9]+$", TOKEN_ID_MARK: True}},
        "n": {"type": "integer", "minimum": 1},
    }
    bounded = bounded_by_vocabulary(document, 1000)
    assert bounded["ids"]["items"]["maximum"] == 999
    assert bounded["bias"]["propertyNames"]["pattern"] == decimal_at_most(999)
    assert bounded["n"] == document["n"] and "maximum" not in document["ids"]["items"]  # a copy
