"""Paged attention through blockserve's custom ops: keys and values are read in place from the
cache blocks through each request's block table (no gather, no padding), decodes and prefill
chunks in one call, causal by absolute position, with an online softmax over key spans."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import paddle

from worker.inputs.step_inputs import StepInputs
from worker.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from worker.inputs.model_inputs import ModelInputs

QUERY_TILE = 16  # queries of one request attended together: their keys are read once per tile


@dataclass(frozen=True)
class CustomAttentionMetadata:
    positions: paddle.Tensor  # [tokens]
    slot_mapping: paddle.Tensor  # [tokens]
    query_start: paddle.Tensor  # [requests + 1]
    context_lens: paddle.Tensor  # [requests]
    block_table: paddle.Tensor  # [requests, max blocks]


class HostAttentionMetadata:
    """A step's attention inputs on the host, made into tensors as the ops ask: bs_decoder_stack takes them and the
    step's token ids in one int64 tensor (`layout`), the single ops each its own (`split`). A tensor from numpy is
    a ~15 us Paddle call, and ~60-90 us right after a step of one sequence, whose weights stream through every
    cache: five of them spent 130-220 us of a 4-5 ms gguf step (AMD EPYC Zen 4, 2 threads)."""

    def __init__(self, inputs: StepInputs):
        self.inputs = inputs

    @functools.cached_property
    def layout(self) -> paddle.Tensor:
        """int64 [3 + 3 tokens + 2 requests + 1 + requests * table width]: the numbers of tokens and requests and
        the block table's width, then input_ids, positions, slot_mapping, query_start, context_lens and the block
        table's rows (what StepLayout in custom_ops/cpu/paged_attention.h reads). Made when the forward first asks
        for it, once the step's ids are all known (model_runner.fill_pending_tokens)."""
        i = self.inputs
        counts = np.array([len(i.positions), len(i.context_lens), i.block_table.shape[1]], dtype=np.int64)
        parts = (counts, i.input_ids, i.positions, i.slot_mapping, i.query_start, i.context_lens, i.block_table.ravel())
        return paddle.to_tensor(np.concatenate(parts).astype(np.int64, copy=False))

    @functools.cached_property
    def split(self) -> CustomAttentionMetadata:
        i = self.inputs
        arrays = (i.positions, i.slot_mapping, i.query_start, i.context_lens, i.block_table)
        return CustomAttentionMetadata(*(paddle.to_tensor(array) for array in arrays))

    positions = property(lambda self: self.split.positions)
    slot_mapping = property(lambda self: self.split.slot_mapping)
    query_start = property(lambda self: self.split.query_start)
    context_lens = property(lambda self: self.split.context_lens)
    block_table = property(lambda self: self.split.block_table)


def step_layout(inputs: ModelInputs) -> paddle.Tensor:
    """The step's ids and attention metadata as HostAttentionMetadata.layout lays them out: that layout itself, or
    one built from the ids tensor and the five metadata tensors."""
    metadata = inputs.attention_metadata
    if isinstance(metadata, HostAttentionMetadata):
        return metadata.layout
    block_table = metadata.block_table
    counts = [metadata.positions.shape[0], metadata.context_lens.shape[0], block_table.shape[1]]
    parts = [inputs.input_ids, metadata.positions, metadata.slot_mapping, metadata.query_start, metadata.context_lens]
    return paddle.concat([paddle.to_tensor(counts, dtype="int64"), *parts, block_table.reshape([-1])])


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

    def prepare(self, inputs: StepInputs) -> HostAttentionMetadata:
        return HostAttentionMetadata(inputs)

    def attend_qkv(
        self, qkv, key_cache, value_cache, metadata: CustomAttentionMetadata | HostAttentionMetadata
    ) -> paddle.Tensor:
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
