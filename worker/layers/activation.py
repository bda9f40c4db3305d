"""The MLP's activation in plain Paddle: the reference of the custom op bs_silu_and_mul."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F


def silu_and_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    """silu(gate) * up of the fused [tokens, 2 * intermediate] gate|up output."""
    gate, up = paddle.chunk(gate_up, 2, axis=-1)
    return F.silu(gate) * up
