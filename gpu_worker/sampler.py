"""Pick the next token of every request that finished its scheduled tokens, vectorised over the batch.

Order, as in vLLM: penalties and logit_bias, then greedy (temperature 0) or temperature, min_p, top_k, top_p and
an inverse-CDF draw. The draw of a seeded request is a uniform from a generator seeded with
(seed, sequence length), so its tokens do not depend on its batch mates and repeat exactly after
preemption and recompute. Logprobs come from the raw model logits.

Rows without top_k/top_p draw over the vocabulary in id order (no sort); only rows that truncate
pay for a top-k (or, without top_k, a full sort).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import paddle
import paddle.nn.functional as F

from gpu_worker.penalties import SamplingRequest, apply_logit_bias, apply_penalties
from gpu_worker.tensor_ops import log_softmax, take_rows
from service import wire

GREEDY_TEMPERATURE = 1e-5  # below this, temperature sampling is argmax


def _rows(tensor: paddle.Tensor, selected: np.ndarray) -> paddle.Tensor:
    return take_rows(tensor, paddle.to_tensor(np.flatnonzero(selected)))


class Sampler:
    """`sample(logits, requests)` -> one SampledToken per row."""

    def __init__(self, seed: int | None = None):
        self._rng = np.random.default_rng(seed)

    def sample(self, logits: paddle.Tensor, requests: Sequence[SamplingRequest]) -> list[wire.SampledToken]:
        params = [r.sampling for r in requests]
        greedy = np.array([p.temperature < GREEDY_TEMPERATURE for p in params])
        truncated = np.array([p.top_k > 0 or p.top_p < 1.0 for p in params]) & ~greedy
        plain = ~greedy & ~truncated
        penalised = apply_logit_bias(apply_penalties(logits, requests), requests)
        uniforms = self._uniforms(requests, ~greedy)
        tokens = np.empty(len(requests), dtype=np.int64)
        if greedy.any():
            tokens[greedy] = paddle.argmax(_rows(penalised, greedy), axis=-1).numpy()
        if plain.any():
            probs = F.softmax(_scaled(_rows(penalised, plain), _select(params, plain)), axis=-1)
            tokens[plain] = _inverse_cdf(probs, uniforms[plain])
        if truncated.any():
            chosen = _select(params, truncated)
            scaled = _scaled(_rows(penalised, truncated), chosen)
            tokens[truncated] = _draw_truncated(scaled, chosen, uniforms[truncated])
        return _with_logprobs(logits, requests, tokens)

    def _uniforms(self, requests: Sequence[SamplingRequest], needed: np.ndarray) -> np.ndarray:
        """One uniform in [0, 1) per request: seeded from (seed, length) or from the worker's generator."""
        uniforms = self._rng.random(len(requests))
        for row in np.flatnonzero(needed):
            seed = requests[row].sampling.seed
            if seed is not None:
                uniforms[row] = np.random.default_rng([seed % 2**64, len(requests[row].token_ids)]).random()
        return uniforms


def _select(params: list[wire.SamplingParams], selected: np.ndarray) -> list[wire.SamplingParams]:
    return [params[i] for i in np.flatnonzero(selected)]


def _scaled(logits: paddle.Tensor, params: list[wire.SamplingParams]) -> paddle.Tensor:
    """Logits divided by temperature, with tokens under min_p times the top probability removed."""
    temperature = np.array([[p.temperature] for p in params], dtype=np.float32)
    logits = logits / paddle.to_tensor(temperature)
    # Capped at 1 so the floor never rises above the top probability: the most likely token stays.
    min_p = np.minimum(np.array([[p.min_p] for p in params], dtype=np.float32), 1.0)
    if (min_p > 0).any():
        probs = F.softmax(logits, axis=-1)
        floor = paddle.to_tensor(min_p) * probs.max(axis=-1, keepdim=True)
        logits = paddle.where(probs < floor, paddle.full_like(logits, -np.inf), logits)
    return logits


def _draw_truncated(logits: paddle.Tensor, params: list[wire.SamplingParams], uniforms: np.ndarray) -> np.ndarray:
    """Draw among each row's top_k tokens, cut further to the smallest set holding top_p of the mass."""
    vocab_size = logits.shape[-1]
    top_k = np.array([p.top_k if p.top_k > 0 else vocab_size for p in params])
    top_p = np.array([[p.top_p if p.top_p < 1.0 else np.inf] for p in params], dtype=np.float32)
    # Only as many candidates as the largest top_k; a full sort only when some row has no top_k.
    sorted_logits, sorted_ids = paddle.topk(logits, int(min(top_k.max(), vocab_size)), axis=-1)
    beyond_top_k = np.arange(sorted_logits.shape[-1])[None, :] >= top_k[:, None]
    removed = paddle.full_like(sorted_logits, -np.inf)
    sorted_logits = paddle.where(paddle.to_tensor(beyond_top_k), removed, sorted_logits)
    probs = F.softmax(sorted_logits, axis=-1)
    mass_before = paddle.cumsum(probs, axis=-1) - probs
    # The first (most likely) candidate always stays: a top_p of 0, or one that is 0 in float32, keeps it alone.
    kept = (mass_before < paddle.to_tensor(top_p)) | paddle.to_tensor(np.arange(probs.shape[-1])[None, :] == 0)
    probs = paddle.where(kept, probs, paddle.zeros_like(probs))
    picked = _inverse_cdf(probs, uniforms)
    return np.take_along_axis(sorted_ids.numpy(), picked[:, None], axis=-1)[:, 0]


def _inverse_cdf(probs: paddle.Tensor, uniforms: np.ndarray) -> np.ndarray:
    """Index of the first entry whose cumulative (unnormalised) mass exceeds uniform * total."""
    cdf = paddle.cumsum(probs.astype("float64"), axis=-1)
    targets = paddle.to_tensor(uniforms[:, None]) * cdf[:, -1:]
    picked = paddle.searchsorted(cdf, targets, right=True).numpy()[:, 0]
    return np.minimum(picked, probs.shape[-1] - 1)


def _with_logprobs(logits: paddle.Tensor, requests: Sequence[SamplingRequest], tokens: np.ndarray):
    """SampledTokens, with the chosen token's logprob and the top-k for requests that asked."""
    sampled = [wire.SampledToken(r.request_id, int(t)) for r, t in zip(requests, tokens)]
    wanted = np.array([r.sampling.logprobs is not None for r in requests])
    if not wanted.any():
        return sampled
    rows = np.flatnonzero(wanted)
    logprobs = log_softmax(_rows(logits, wanted))
    chosen = paddle.take_along_axis(logprobs, paddle.to_tensor(tokens[rows, None]), axis=-1).numpy()[:, 0]
    max_k = max(requests[row].sampling.logprobs for row in rows)
    top_values, top_ids = (t.numpy() for t in paddle.topk(logprobs, max_k, axis=-1)) if max_k else (None, None)
    for position, row in enumerate(rows):
        k = requests[row].sampling.logprobs
        top = [wire.TokenLogprob(int(top_ids[position, j]), float(top_values[position, j])) for j in range(k)]
        sampled[row] = wire.SampledToken(requests[row].request_id, int(tokens[row]), float(chosen[position]), top)
    return sampled
