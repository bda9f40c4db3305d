"""The pure-Paddle kernels: the reference the custom kernels are tested against, and the fallback wherever they
cannot run. Each call is the function of layers/ or sample/ that computes it in Paddle ops."""

from __future__ import annotations

from worker.attention.reference import RotaryPagedAttention, paddle_paged_attention
from worker.layers.activation import silu_and_mul
from worker.layers.norms import add_rms_norm
from worker.layers.rotary import RotaryEmbedding
from worker.models.config import ModelConfig
from worker.sample import paddle_draw, token_mask


class PaddleKernels:
    """Plain Paddle ops (never paddle's fused RMSNorm op: its CPU kernel is AVX-512 code, SIGILL elsewhere)."""

    name = "paddle"

    def add_rms_norm(self, x, weight, residual, eps: float):
        return add_rms_norm(x, weight, residual, eps)

    def silu_and_mul(self, gate_up):
        return silu_and_mul(gate_up)

    def argmax_rows(self, logits):
        return paddle_draw.argmax_rows(logits)

    def sample_rows(self, logits, params):
        return paddle_draw.sample_rows(logits, params)

    def mask_rows(self, logits, mask):
        return token_mask.mask_rows(logits, mask)

    def attention_problem(self, config: ModelConfig) -> None:
        """None: the pure-Paddle attention takes any heads."""
        return None

    def attention(self, config: ModelConfig, block_size: int, rotary: RotaryEmbedding) -> RotaryPagedAttention:
        return paddle_paged_attention(config, block_size, rotary)

    def fused_stack(self, attention, config: ModelConfig):
        """None: the model runs its layers op by op."""
        return None
