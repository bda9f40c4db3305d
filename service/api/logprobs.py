"""Sampled logprobs in the two shapes OpenAI uses: legacy completions and chat.

JSON has no -Infinity, so an impossible token's logprob is reported as -9999.0 (as vLLM does).
"""

from __future__ import annotations

import math

from service.api.choice import SampledLogprobs
from service.api.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from service.api.served_model import ServedModel

MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def completion_logprobs(model: ServedModel, sampled: list[SampledLogprobs], text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text."""
    tokens, offsets, top = [], [], []
    for entry in sampled:
        token = model.token_text(entry.token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        alternatives = {model.token_text(alt.token_id): finite(alt.logprob) for alt in entry.top}
        alternatives.setdefault(token, finite(entry.logprob))
        top.append(alternatives)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[finite(entry.logprob) for entry in sampled],
        top_logprobs=top,
        text_offset=offsets,
    )


def chat_logprobs(model: ServedModel, sampled: list[SampledLogprobs]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **_top_logprob(model, entry.token_id, entry.logprob).model_dump(),
                top_logprobs=[_top_logprob(model, alt.token_id, alt.logprob) for alt in entry.top],
            )
            for entry in sampled
        ]
    )


def _top_logprob(model: ServedModel, token_id: int, logprob: float) -> TopLogprob:
    return TopLogprob(token=model.token_text(token_id), logprob=finite(logprob), bytes=model.token_bytes(token_id))
