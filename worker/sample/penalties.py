"""Repetition (Hugging Face style), presence and frequency (OpenAI style) penalties and OpenAI's logit_bias
on a batch of logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import paddle

from service.contract import wire


class SamplingRequest(Protocol):
    """What sampling needs of a request: its tokens so far and its parameters."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: wire.SamplingParams


def apply_penalties(logits: paddle.Tensor, requests: Sequence[SamplingRequest]) -> paddle.Tensor:
    """Penalised logits [rows, vocab]; rows whose penalties are neutral come out unchanged."""
    repetition = np.array([r.sampling.repetition_penalty for r in requests], dtype=np.float32)
    presence = np.array([r.sampling.presence_penalty for r in requests], dtype=np.float32)
    frequency = np.array([r.sampling.frequency_penalty for r in requests], dtype=np.float32)
    vocab_size = logits.shape[-1]
    if (repetition != 1.0).any():
        # Every prompt and output token: positive logits divided by the penalty, negative ones multiplied.
        seen = _token_counts(requests, vocab_size, repetition != 1.0, output_only=False) > 0
        penalty = paddle.to_tensor(repetition[:, None])
        penalised = paddle.where(logits > 0, logits / penalty, logits * penalty)
        logits = paddle.where(paddle.to_tensor(seen), penalised, logits)
    if (presence != 0.0).any() or (frequency != 0.0).any():
        counts = _token_counts(requests, vocab_size, (presence != 0.0) | (frequency != 0.0), output_only=True)
        subtract = frequency[:, None] * counts + presence[:, None] * (counts > 0)
        logits = logits - paddle.to_tensor(subtract.astype(np.float32))
    return logits


def apply_logit_bias(logits: paddle.Tensor, requests: Sequence[SamplingRequest]) -> paddle.Tensor:
    """Logits [rows, vocab] with each request's logit_bias added; unchanged when no request has one."""
    if not any(r.sampling.logit_bias for r in requests):
        return logits
    bias = np.zeros(logits.shape, dtype=np.float32)
    for row, request in enumerate(requests):
        for token_id, value in request.sampling.logit_bias.items():
            bias[row, token_id] = value
    return logits + paddle.to_tensor(bias)


def _token_counts(
    requests: Sequence[SamplingRequest], vocab_size: int, rows: np.ndarray, output_only: bool
) -> np.ndarray:
    """[rows, vocab] occurrence counts of each request's tokens (only for rows marked in `rows`)."""
    flat = [
        np.asarray(r.token_ids[r.num_prompt_tokens if output_only else 0 :], dtype=np.int64) + row * vocab_size
        for row, r in enumerate(requests)
        if rows[row]
    ]
    counts = np.bincount(np.concatenate(flat), minlength=len(requests) * vocab_size)
    return counts.reshape(len(requests), vocab_size).astype(np.float32)
