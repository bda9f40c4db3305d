"""Schemathesis hooks for the conformance run (SCHEMATHESIS_HOOKS): keep each generation small.

On a CPU the real model makes a few tokens per second per sequence, so a generated request for
128 choices of the whole context would take minutes. Sizes the spec allows are capped here;
everything else (invalid values, missing fields, odd types) goes out as generated.
"""

from __future__ import annotations

import schemathesis

MAX_CHOICES = 2
MAX_NEW_TOKENS = 4
NEW_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if _is_count(body.get("n")) and body["n"] > MAX_CHOICES:
        body["n"] = MAX_CHOICES
    for field in NEW_TOKEN_FIELDS:
        if _is_count(body.get(field)) and body[field] > MAX_NEW_TOKENS:
            body[field] = MAX_NEW_TOKENS
    if not any(field in body for field in NEW_TOKEN_FIELDS):
        body["max_tokens"] = MAX_NEW_TOKENS  # the defaults: 16 tokens, or a chat's whole remaining context


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
