"""Paged attention through blockserve's custom ops: keys and values are read in place from the
cache blocks through each request's block table (no gather, no padding), decodes and prefill
chunks in one call, causal by absolute position, with an online softmax over key spans."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import paddle

from gpu_worker.models.rope import RotaryEmbedding
from gpu_worker.step_inputs import StepInputs

QUERY_TILE = 16  # queries of one request attended together: their keys are read once per tile


@dataclass(frozen=True)
class CustomAttentionMetadata:
    positions: paddle.Tensor  # [tokens]
    slot_mapping: paddle.Tensor  # [tokens]
    query_start: paddle.Tensor  # [requests + 1]
    context_lens: paddle.Tensor  # [requests]
    block_table: paddle.Tensor  # [requests, max blocks]


class CustomPagedAttention:
    """attend_qkv: rotary embedding and cache write in one op, then the paged attention op."""

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

    def prepare(self, inputs: StepInputs) -> CustomAttentionMetadata:
        return CustomAttentionMetadata(
            positions=paddle.to_tensor(inputs.positions),
            slot_mapping=paddle.to_tensor(inputs.slot_mapping),
            query_start=paddle.to_tensor(inputs.query_start),
            context_lens=paddle.to_tensor(inputs.context_lens),
            block_table=paddle.to_tensor(inputs.block_table),
        )

    def attend_qkv(self, qkv, key_cache, value_cache, metadata: CustomAttentionMetadata) -> paddle.Tensor:
        """Attention output [tokens, heads * dim] of the fused q|k|v projection [tokens, (heads + 2 kv_heads) * dim]."""
        query, _, _ = self.ops.bs_rope_write_kv(
            qkv,
            metadata.positions,
            self.rotary.cos,
            self.rotary.sin,
            metadata.slot_mapping,
            key_cache,
            value_cache,
            self.num_heads,
            self.num_kv_heads,
            self.isa,
        )
        return self.ops.bs_paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.query_start,
            metadata.context_lens,
            metadata.block_table,
            self.query_tile,
            self.isa,
        )
