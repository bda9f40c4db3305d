"""What the model asks of its kernels, on whichever path serves it: the pure-Paddle reference
(kernels/reference.py), the C++ CPU ops (kernels/cpu.py) or the CUDA ops (kernels/cuda.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import paddle

if TYPE_CHECKING:
    from worker.attention.backend import AttentionBackend
    from worker.layers.rotary import RotaryEmbedding
    from worker.models.config import ModelConfig
    from worker.sample.token_mask import TokenMask


class Kernels(Protocol):
    """Norms, activation, sampling and attention of one kernel path; chosen once per worker (kernels/selection.py)."""

    name: str  # paddle | custom | cuda: reported at start-up; layers/linear.py packs weights for "custom"

    def add_rms_norm(
        self, x: paddle.Tensor, weight: paddle.Tensor, residual: paddle.Tensor | None, eps: float
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(rms_norm(x + residual) * weight, x + residual); residual may be None."""
        ...

    def silu_and_mul(self, gate_up: paddle.Tensor) -> paddle.Tensor:
        """silu(gate) * up of the fused [tokens, 2 * intermediate] gate|up output."""
        ...

    def argmax_rows(self, logits: paddle.Tensor) -> paddle.Tensor:
        """int64 [rows]: each row's largest entry (greedy sampling)."""
        ...

    def sample_rows(self, logits: paddle.Tensor, params: np.ndarray) -> paddle.Tensor:
        """int64 [rows]: each row's draw (sample/paddle_draw.py says what `params` holds)."""
        ...

    def mask_rows(self, logits: paddle.Tensor, mask: TokenMask) -> paddle.Tensor:
        """Logits with the tokens each masked row's grammar forbids at -inf (sample/token_mask.py)."""
        ...

    def attention_problem(self, config: ModelConfig) -> str | None:
        """Why these kernels' attention cannot take the model's heads (then the pure-Paddle attention serves it,
        in float32: layers/precision.py), or None."""
        ...

    def attention(self, config: ModelConfig, block_size: int, rotary: RotaryEmbedding) -> AttentionBackend:
        """The attention for the model's heads: these kernels' own, or the pure-Paddle one where
        attention_problem says why not."""
        ...

    def fused_stack(self, attention: AttentionBackend, config: ModelConfig) -> Callable | None:
        """A callable running every decoder layer of a step in one op, or None: the layers run op by op."""
        ...
