"""RMS norm with the residual add fused in front, in plain Paddle: the reference of the custom ops
bs_rms_norm and bs_add_rms_norm."""

from __future__ import annotations

import paddle


def add_rms_norm(x: paddle.Tensor, weight: paddle.Tensor, residual: paddle.Tensor | None, eps: float):
    """(rms_norm(x + residual) * weight, x + residual); residual may be None. Never paddle's fused RMSNorm op: its
    CPU kernel is AVX-512 code, SIGILL elsewhere."""
    summed = x if residual is None else x + residual
    normed = summed * paddle.rsqrt(summed.square().mean(axis=-1, keepdim=True) + eps) * weight
    return normed, summed
