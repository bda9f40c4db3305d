"""Paged attention through blockserve's custom ops, the C++ ones on a CPU and the CUDA ones on a GPU (the same op
names): keys and values are read in place from the cache blocks through each request's block table (no gather, no
padding), decodes and prefill chunks in one call, causal by absolute position, with an online softmax over key
spans."""

from __future__ import annotations

from types import ModuleType

import paddle

from worker.attention.backend import LayerAttention
from worker.attention.metadata import CustomAttentionMetadata, HostAttentionMetadata
from worker.inputs.step_inputs import StepInputs
from worker.layers.rotary import RotaryEmbedding

QUERY_TILE = 16  # queries of one request attended together: their keys are read once per tile


class CustomPagedAttention:
    """attend_qkv: rotary embedding and cache write in one op, then the paged attention op. A layer's own rotary,
    scale, sliding window and soft cap it takes (the fused decoder stack none of the last two: config.is_llama_layer)."""

    def __init__(
        self,
        ops: ModuleType,
        num_heads: int,
        num_kv_heads: int,
        rotary: RotaryEmbedding,
        isa: int,
        query_tile: int = QUERY_TILE,
    ):
        self.ops = ops
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.rotary = rotary
        self.isa = isa  # the ops' isa bits
        self.query_tile = query_tile

    def prepare(self, inputs: StepInputs) -> HostAttentionMetadata:
        return HostAttentionMetadata(inputs)

    def attend_qkv(
        self,
        qkv,
        key_cache,
        value_cache,
        metadata: CustomAttentionMetadata | HostAttentionMetadata,
        layer: LayerAttention | None = None,
    ) -> paddle.Tensor:
        """Attention output [tokens, heads * dim] of the fused q|k|v projection [tokens, (heads + 2 kv_heads) * dim]."""
        rotary = self.rotary if layer is None else layer.rotary
        query, _, _ = self.ops.bs_rope_write_kv(
            qkv,
            metadata.positions,
            rotary.cos,
            rotary.sin,
            metadata.slot_mapping,
            key_cache,
            value_cache,
            self.num_heads,
            self.num_kv_heads,
            self.isa,
        )
        if layer is not None and layer.scale is not None:  # the op scales q.k by head_dim ** -0.5
            query = query * (layer.scale * rotary.cos.shape[-1] ** 0.5)
        return self.ops.bs_paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.query_start,
            metadata.context_lens,
            metadata.block_table,
            self.query_tile,
            0 if layer is None or layer.sliding_window is None else layer.sliding_window,
            0.0 if layer is None or layer.softcap is None else layer.softcap,
            self.isa,
        )
