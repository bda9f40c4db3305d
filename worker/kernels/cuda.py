"""blockserve's CUDA kernels (custom_ops/gpu) as the worker's kernels on a GPU.

The CUDA ops take the CPU ops' names and arguments (the `isa` bits attribute is ignored), on
tensors of the model's dtype, so the calls are the CPU custom kernels' own; linear layers stay
Paddle's matmul (cuBLAS) on weights in the model's dtype, as the name "cuda" tells worker/layers/linear.py,
and a layer runs op by op (bs_decoder_stack is a CPU op only).
"""

from __future__ import annotations

from types import ModuleType

from worker.kernels.cpu import CustomKernels
from worker.kernels.cpu_isa import IsaSet
from worker.models.config import ModelConfig
from worker.sample import paddle_draw, token_mask

MAX_HEAD_DIM = 256  # custom_ops/gpu/attention_kernels.cuh: kMaxHeadDim, kMaxRows, 16-byte rows
MAX_GROUP = 32


def attention_shape_problem(config: ModelConfig) -> str | None:
    """Why the CUDA attention kernel cannot take this model's heads, or None."""
    group = config.num_heads // config.num_kv_heads
    if config.head_dim % 8 or config.head_dim > MAX_HEAD_DIM:
        return f"head_dim {config.head_dim} is not a multiple of 8 up to {MAX_HEAD_DIM}"
    if group > MAX_GROUP:
        return f"{group} query heads share a kv head (at most {MAX_GROUP})"
    return None  # sliding windows and soft caps too: bs_paged_attention takes them


class CudaKernels(CustomKernels):
    """The CUDA ops behind the custom kernels' calls."""

    name = "cuda"

    def __init__(self, ops: ModuleType):
        super().__init__(ops, IsaSet(), fuse_layers=False)

    def attention_problem(self, config: ModelConfig) -> str | None:
        return attention_shape_problem(config)

    def fused_stack(self, attention, config: ModelConfig):
        """None: there is no CUDA bs_decoder_stack, so the model runs its layers op by op."""
        return None

    def argmax_rows(self, logits):
        return paddle_draw.argmax_rows(logits)

    def sample_rows(self, logits, params):
        return paddle_draw.sample_rows(logits, params)

    def mask_rows(self, logits, mask):
        """Paddle's where over the bits unpacked on the GPU from their packed words (bs_mask_rows is a CPU op only)."""
        return token_mask.mask_rows(logits, mask)
