"""A draw without top_k/top_p in Paddle ops: temperature, min_p, then the inverse CDF. The reference for the
custom CPU op bs_sample_rows and the path of the other kernels; the truncated draw shares its steps.

`params` rows are (temperature > 0, min_p in [0, 1], uniform in [0, 1)), float64.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F


def sample_rows(logits: paddle.Tensor, params: np.ndarray) -> paddle.Tensor:
    """int64 [rows]: each row's draw from softmax(logits / temperature) without the tokens under min_p."""
    probs = F.softmax(scaled_logits(logits, params[:, 0:1], params[:, 1:2]), axis=-1)
    return inverse_cdf(probs, params[:, 2])


def scaled_logits(logits: paddle.Tensor, temperatures: np.ndarray, min_ps: np.ndarray) -> paddle.Tensor:
    """Logits divided by temperature ([rows, 1]), with tokens under min_p ([rows, 1], at most 1) times the top
    probability removed."""
    logits = logits / paddle.to_tensor(temperatures.astype(np.float32))
    if (min_ps > 0).any():
        probs = F.softmax(logits, axis=-1)
        floor = paddle.to_tensor(min_ps.astype(np.float32)) * probs.max(axis=-1, keepdim=True)
        logits = paddle.where(probs < floor, paddle.full_like(logits, -np.inf), logits)
    return logits


def inverse_cdf(probs: paddle.Tensor, uniforms: np.ndarray) -> paddle.Tensor:
    """Index of the first entry whose cumulative (unnormalised) mass exceeds uniform * total."""
    cdf = paddle.cumsum(probs.astype("float64"), axis=-1)
    targets = paddle.to_tensor(uniforms[:, None]) * cdf[:, -1:]
    picked = paddle.searchsorted(cdf, targets, right=True)[:, 0]
    return paddle.minimum(picked, paddle.full_like(picked, probs.shape[-1] - 1)).astype("int64")
