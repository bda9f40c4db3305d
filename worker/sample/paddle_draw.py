"""Each row's draw in Paddle ops: the argmax (greedy), or from its distribution: temperature and min_p, then the
inverse CDF, over the vocabulary in id order, or (with top_k or top_p) over the top_k largest cut to the smallest
prefix holding top_p of their mass, from the largest down. The reference for the custom CPU ops bs_argmax_rows and
bs_sample_rows, and the path of the other kernels.

`params` rows are (temperature > 0, min_p in [0, 1], uniform in [0, 1), top_k (0: none), top_p (>= 1: none)),
float64.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from worker.layers.row_gather import take_rows


def argmax_rows(logits: paddle.Tensor) -> paddle.Tensor:
    """int64 [rows]: each row's largest entry (greedy sampling)."""
    return paddle.argmax(logits, axis=-1).astype("int64")


def sample_rows(logits: paddle.Tensor, params: np.ndarray) -> paddle.Tensor:
    """int64 [rows]: each row's draw."""
    truncated = (params[:, 3] > 0) | (params[:, 4] < 1.0)
    if not truncated.any():
        return _in_id_order(logits, params)
    if truncated.all():
        return _truncated(logits, params)
    plain_rows, truncated_rows = np.flatnonzero(~truncated), np.flatnonzero(truncated)
    plain = _in_id_order(take_rows(logits, paddle.to_tensor(plain_rows)), params[plain_rows])
    cut = _truncated(take_rows(logits, paddle.to_tensor(truncated_rows)), params[truncated_rows])
    return in_row_order([plain_rows, truncated_rows], [plain, cut])


def _scaled_logits(logits: paddle.Tensor, params: np.ndarray) -> paddle.Tensor:
    """Logits divided by temperature, with tokens under min_p (at most 1) times the top probability removed."""
    logits = logits / paddle.to_tensor(params[:, 0:1].astype(np.float32))
    min_ps = params[:, 1:2].astype(np.float32)
    if (min_ps > 0).any():
        probs = F.softmax(logits, axis=-1)
        floor = paddle.to_tensor(min_ps) * probs.max(axis=-1, keepdim=True)
        logits = paddle.where(probs < floor, paddle.full_like(logits, -np.inf), logits)
    return logits


def _in_id_order(logits: paddle.Tensor, params: np.ndarray) -> paddle.Tensor:
    return _inverse_cdf(F.softmax(_scaled_logits(logits, params), axis=-1), params[:, 2])


def _truncated(logits: paddle.Tensor, params: np.ndarray) -> paddle.Tensor:
    """Draw among each row's top_k tokens, cut further to the smallest set holding top_p of the mass."""
    logits = _scaled_logits(logits, params)
    vocab_size = logits.shape[-1]
    top_k = np.where(params[:, 3] > 0, params[:, 3], vocab_size).astype(np.int64)
    top_p = np.where(params[:, 4] < 1.0, params[:, 4], np.inf).astype(np.float32)[:, None]
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
    picked = _inverse_cdf(probs, params[:, 2])
    return paddle.take_along_axis(sorted_ids, picked.unsqueeze(-1), axis=-1).squeeze(-1).astype("int64")


def _inverse_cdf(probs: paddle.Tensor, uniforms: np.ndarray) -> paddle.Tensor:
    """Index of the first entry whose cumulative (unnormalised) mass exceeds uniform * total."""
    cdf = paddle.cumsum(probs.astype("float64"), axis=-1)
    targets = paddle.to_tensor(uniforms[:, None]) * cdf[:, -1:]
    picked = paddle.searchsorted(cdf, targets, right=True)[:, 0]
    return paddle.minimum(picked, paddle.full_like(picked, probs.shape[-1] - 1)).astype("int64")


def in_row_order(groups: list[np.ndarray], group_tokens: list[paddle.Tensor]) -> paddle.Tensor:
    """The groups' tokens back in row order (groups: each group's rows, together every row once): row i is entry
    position_of_row[i] of the groups' concatenation."""
    if len(groups) == 1:  # the group is every row, in order
        return group_tokens[0]
    position_of_row = np.argsort(np.concatenate(groups))
    return paddle.gather(paddle.concat(group_tokens), paddle.to_tensor(position_of_row))
