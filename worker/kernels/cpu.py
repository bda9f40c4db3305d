"""blockserve's C++ CPU ops (custom_ops/cpu) as the worker's kernels."""

from __future__ import annotations

from types import ModuleType

import paddle

from worker.attention.custom_kernels import CustomPagedAttention
from worker.attention.reference import paddle_paged_attention
from worker.kernels.cpu_isa import IsaSet
from worker.layers.rotary import RotaryEmbedding
from worker.models.config import ModelConfig
from worker.models.llama_decoder_stack import FusedDecoderStack


class CustomKernels:
    """blockserve's custom ops (custom_ops/cpu): AVX2 + FMA, and AVX-512 with its BF16 and VNNI dot products
    where the CPU has them and they are allowed."""

    name = "custom"

    def __init__(self, ops: ModuleType, isa: IsaSet, fuse_layers: bool = True):
        self.ops = ops
        self.isa = isa
        self.fuse_layers = fuse_layers  # one bs_decoder_stack call per step instead of nine ops per layer
        self._stack: FusedDecoderStack | None = None

    def add_rms_norm(self, x, weight, residual, eps: float):
        if residual is None:
            return self.ops.bs_rms_norm(x, weight, eps, self.isa.bits), x
        return self.ops.bs_add_rms_norm(x, residual, weight, eps, self.isa.bits)

    def silu_and_mul(self, gate_up):
        return self.ops.bs_silu_and_mul(gate_up, self.isa.bits)

    def argmax_rows(self, logits):
        """Paddle's CPU argmax takes ~2 ms over a [64, 49152] batch, on one thread: greedy sampling of that batch
        took 2.66 ms with it and 0.15 ms with this op (Sampler.draw on a 2-core EPYC)."""
        return self.ops.bs_argmax_rows(logits, self.isa.bits)

    def sample_rows(self, logits, params):
        """Paddle's CPU ops for the draw take 37-41 ms over a [64, 49152] batch at temperature 1 and 215-270 ms
        with top_p (on one thread each): as long as the model's step, or six; bs_sample_rows draws as
        sample/paddle_draw.py does."""
        return self.ops.bs_sample_rows(logits, paddle.to_tensor(params, dtype="float64"), self.isa.bits)

    def mask_rows(self, logits, mask):
        """NumPy's unpacking and Paddle's where took ~21 ms for 64 rows of SmolLM2's 49152 logits, about three
        copies' time; bs_mask_rows reads the packed bits in one pass."""
        return self.ops.bs_mask_rows(logits, paddle.to_tensor(mask.bitmask), paddle.to_tensor(mask.rows))

    def attention_problem(self, config: ModelConfig) -> str | None:
        if config.head_dim % 16:  # the attention kernel works on whole AVX-512 vectors of a head
            return f"head_dim {config.head_dim} is not a multiple of 16"
        return None  # sliding windows and soft caps too: bs_paged_attention takes them

    def attention(self, config: ModelConfig, block_size: int, rotary: RotaryEmbedding):
        if self.attention_problem(config):
            return paddle_paged_attention(config, block_size, rotary)
        return CustomPagedAttention(self.ops, config.num_heads, config.num_kv_heads, rotary, self.isa.bits)

    def fused_stack(self, attention, config: ModelConfig) -> FusedDecoderStack | None:
        """A callable running every decoder layer of a step in one op, or None where the layers run op by op
        (the attention is the pure-Paddle one, the model's layers are not Llama's, or fusing is off)."""
        if not self.fuse_layers or not isinstance(attention, CustomPagedAttention) or not config.is_llama_layer:
            return None
        stack = self._stack
        if stack is None or stack.attention is not attention or stack.config is not config:
            if stack is not None:
                stack.release()
            stack = self._stack = FusedDecoderStack(self.ops, attention, config)  # one per model: it holds the inputs
        return stack
