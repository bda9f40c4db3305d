"""The MLP's activations in plain Paddle: SwiGLU (the reference of the custom op bs_silu_and_mul) and GeGLU with
tanh GELU (Gemma's, on every path)."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F


def silu_and_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    """silu(gate) * up of the fused [tokens, 2 * intermediate] gate|up output."""
    gate, up = paddle.chunk(gate_up, 2, axis=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    """gelu_tanh(gate) * up of the fused [tokens, 2 * intermediate] gate|up output."""
    gate, up = paddle.chunk(gate_up, 2, axis=-1)
    return F.gelu(gate, approximate=True) * up
